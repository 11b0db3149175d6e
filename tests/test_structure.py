"""The package's structure: its layers, its import graph (no cycles; every module imports
first in a fresh interpreter), the transport folders and the registry, what importing it
loads, and the size of its modules and functions."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests import import_graph
from tests.import_graph import LAYERS, layer
from weightsync.core import registry

PACKAGE = Path(__file__).resolve().parent.parent / "weightsync"


# --- layering --------------------------------------------------------------------------


def test_importing_weightsync_loads_no_dtensor_yet_a_dtensor_is_told_once_one_exists() -> None:
    """Every actor imports weightsync at its start; DTensor's package costs more than the rest
    of it together, so it is loaded only by whoever makes DTensors."""
    code = """
import sys
import torch
import torch.distributed as dist
import weightsync, weightsync.glue.actors, weightsync.core.sharded, weightsync.transports.owner_writes.halves
from weightsync.core.dtensors import is_dtensor
loaded = [m for m in sys.modules if m.startswith("torch.distributed.tensor")]
plain = torch.randn(4, 2)
before = is_dtensor(plain)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
sharded = distribute_tensor(plain, init_device_mesh("cpu", (1,)), [Shard(0)])
print(loaded, before, is_dtensor(sharded), is_dtensor(plain), is_dtensor(sharded.to_local()))
dist.destroy_process_group()
"""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "False", "True", "False", "False"], done.stdout


#: Below glue/ nothing needs a cluster: no Ray there.
RAY_FREE_BELOW = LAYERS["weightsync.glue"]
#: The transports that build on another one's modules (its halves, setup steps, messages).
BUILDS_ON = {"owners": {"broadcast"}, "owner_writes": {"direct"}, "rank_ipc": {"ipc"}}


def transport_of(module: str) -> str | None:
    """The built-in transport folder ``module`` lies in, if any."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "transports" else None


def test_the_import_graph_resolves_submodules_and_sees_imports_inside_functions() -> None:
    """The graph these rules read is the one Python follows: ``from pkg import module`` is an
    edge to the module, and an import inside a function is an edge too."""
    graph = import_graph.build()
    assert "weightsync.core.registry" in graph.edges["weightsync.glue.round"]  # from weightsync.core import registry
    assert "weightsync.mechanisms.nccl" in graph.edges["weightsync.transports.broadcast.plugin"]  # inside a function
    assert "weightsync.core" not in graph.edges["weightsync.glue.round"]
    looped = import_graph.Graph(edges={"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, external={})
    assert looped.cycle() == ["a", "b", "c", "a"]


def test_no_module_imports_in_a_cycle() -> None:
    cycle = import_graph.build().cycle()
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_no_layer_imports_one_above_it_and_nothing_below_glue_imports_ray() -> None:
    """core/ and the mechanisms (and the transports) import no Ray, the mechanisms no
    transport and no endpoint, and the library never imports its CLI (tools/)."""
    graph = import_graph.build()
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in graph.edges.items()
        for target in targets
        if layer(target) > layer(module)
    )
    assert not upward, f"imports of a higher layer: {upward}"
    ray = sorted(
        m
        for m, names in graph.external.items()
        if {n.split(".")[0] for n in names} & {"ray"} and layer(m) < RAY_FREE_BELOW
    )
    assert not ray, f"{ray} import Ray; everything below glue/ runs without a cluster"


def test_nothing_outside_a_transports_folder_names_it_and_each_folder_is_registered() -> None:
    """Only ``transports/<name>/`` imports its modules (and the transports that declare they
    build on it); the registry knows every folder, by dotted path, and nothing else."""
    graph = import_graph.build()
    strays = sorted(
        f"{module} -> {target}"
        for module, targets in graph.edges.items()
        for target in targets
        if (owner := transport_of(target)) is not None
        and transport_of(module) != owner
        and owner not in BUILDS_ON.get(transport_of(module) or "", set())
    )
    assert not strays, f"a built-in transport named outside its folder: {strays}"
    folders = {p.name for p in (import_graph.PACKAGE / "transports").iterdir() if (p / "plugin.py").is_file()}
    listed = {**registry.BUILTIN_TRANSPORTS, **registry.BUILTIN_MODES}
    assert {path.split(".")[2] for path in listed.values()} == folders
    assert all(
        path.startswith("weightsync.transports.") and path.endswith(":" + path.split(":")[1])
        for path in listed.values()
    )


def test_importing_weightsync_imports_no_transport_until_one_is_used() -> None:
    code = """
import sys
import weightsync
from weightsync.core import registry
def loaded():
    return sorted({m.split(".")[2] for m in sys.modules if m.startswith("weightsync.transports.")})
before = loaded()
names = registry.names()
registry.get("ipc")
print(before, loaded(), "broadcast" in names)
"""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "['ipc']", "True"], done.stdout


#: Run in one fresh interpreter: the third-party packages the library imports are loaded
#: once, then every module is imported first, each in a process forked before any module
#: of weightsync was loaded (so each sees the state a fresh interpreter gives it).
_IMPORT_EACH = """
import importlib, os, sys, traceback
for name in sys.argv[1].split(","):
    try:
        importlib.import_module(name)
    except Exception:
        pass
assert not [m for m in sys.modules if m == "weightsync" or m.startswith("weightsync.")]
running = {}

def start(module):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(module)
            os._exit(0)
        except BaseException:
            os.write(write, traceback.format_exc().encode()[-2000:])
            os._exit(1)
    os.close(write)
    running[pid] = (module, read)

def finish():
    pid, status = os.wait()
    module, read = running.pop(pid)
    with os.fdopen(read, "rb") as pipe:
        text = pipe.read().decode(errors="replace").strip()
    if status != 0:
        print("FAILED-IMPORT", module, (text.splitlines() or [str(status)])[-1])

for module in sys.argv[2:]:
    if len(running) >= 2:
        finish()
    start(module)
while running:
    finish()
"""


def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    """No module loads only because another was imported before it (an import cycle that
    happens to work in the order ``weightsync/__init__`` imports things)."""
    graph = import_graph.build()
    third_party = sorted({name for names in graph.external.values() for name in names})
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _IMPORT_EACH,
            ",".join(third_party),
            *sorted(set(graph.edges) - {"weightsync.__main__"}),
        ],
        cwd=PACKAGE.parent,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED-IMPORT")]
    assert not failed, "modules that fail to import first:\n" + "\n".join(failed)


# --- sizes -----------------------------------------------------------------------------

#: No module of the package is longer, nor any function (methods and nested functions
#: alike, counted from ``def`` to its last line): one module one job, and a function a
#: reader holds in view. Split by job, never one job across files, to stay within them.
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def oversized(source: str, name: str) -> list[str]:
    """What in ``source`` (module ``name``) is over the limits, one line each."""
    found = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{name}: {lines} lines (at most {MAX_MODULE_LINES})")

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(
                        f"{name}:{child.lineno} {prefix}{child.name}: {length} lines (at most {MAX_FUNCTION_LINES})"
                    )
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_no_module_is_over_400_lines_and_no_function_over_60() -> None:
    found = [
        line
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in oversized(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    ]
    assert not found, "over the size limits (split by job):\n" + "\n".join(found)


def test_the_size_check_counts_every_function_and_module_line() -> None:
    """60 lines pass and 61 fail, for a method and a function nested in it alike; a module
    of 401 lines fails."""

    def function(name: str, lines: int, indent: str = "") -> str:
        body = "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))
        return f"{indent}def {name}():\n{body}"

    assert oversized(function("f", MAX_FUNCTION_LINES), "m") == []
    nested = "class C:\n    def g(self):\n" + function("h", MAX_FUNCTION_LINES + 1, "        ")
    assert oversized(nested, "m") == [
        f"m:2 C.g: {MAX_FUNCTION_LINES + 2} lines (at most {MAX_FUNCTION_LINES})",
        f"m:3 C.g.h: {MAX_FUNCTION_LINES + 1} lines (at most {MAX_FUNCTION_LINES})",
    ]
    assert oversized("x = 0\n" * (MAX_MODULE_LINES + 1), "m") == [
        f"m: {MAX_MODULE_LINES + 1} lines (at most {MAX_MODULE_LINES})"
    ]
