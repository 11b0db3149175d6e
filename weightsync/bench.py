import argparse
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.set_defaults(func=lambda a: 0)
