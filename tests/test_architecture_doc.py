"""docs/architecture.md stays true to the tree: every module, package and file it names
exists, every package has its section, and its layer table is the one tests/test_structure.py
enforces. Nothing is imported: names are resolved against the source."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.import_graph import LAYERS, PACKAGE, ROOT, layer, layer_prefix, module_name

DOC = ROOT / "docs" / "architecture.md"
#: Backticked text that names a file or folder: ``core/sender.py``, ``glue/``, ``tests/x.py``.
PATHLIKE = re.compile(r"^[\w./<>-]+(\.py|/)$")
#: A dotted name in the package: ``weightsync.core.registry`` or one of its attributes.
DOTTED = re.compile(r"^weightsync(\.\w+)+$")
HEADING = re.compile(r"^### `(weightsync/[\w/]*)`")
BULLET = re.compile(r"^- ((?:`\w+\.py`(?:, )?)+):")
LAYER_ROW = re.compile(r"^layer (\d+)  (\S.*?)(?:  |$)")
LINK = re.compile(r"\]\(([\w./-]+\.md)(?:#[\w-]+)?\)")
#: Top-level folders of the repository a path may start with; any other is read from weightsync/.
REPO_FOLDERS = ("weightsync/", "tests/", "scripts/", "docs/", "examples/")


@dataclass
class Doc:
    """What the document names: per section heading's package, the modules listed under it;
    every other backticked path and dotted name; the layer table's rows; its links."""

    packages: dict[str, list[str]] = field(default_factory=dict)
    paths: list[tuple[str | None, str]] = field(default_factory=list)
    dotted: list[str] = field(default_factory=list)
    layers: list[tuple[int, list[str]]] = field(default_factory=list)
    links: list[str] = field(default_factory=list)


def read_doc(text: str) -> Doc:
    doc = Doc()
    package: str | None = None
    for line in text.splitlines():
        if line.startswith("#"):
            heading = HEADING.match(line)
            package = heading.group(1) if heading else None
            if package is not None:
                doc.packages.setdefault(package, [])
        if (row := LAYER_ROW.match(line)) is not None:
            doc.layers.append((int(row.group(1)), row.group(2).split()))
        if package is not None and (bullet := BULLET.match(line)) is not None:
            doc.packages[package] += re.findall(r"`(\w+\.py)`", bullet.group(1))
        doc.links += LINK.findall(line)
        for token in re.findall(r"`([^`\s]+)`", line):
            if DOTTED.match(token):
                doc.dotted.append(token)
            elif PATHLIKE.match(token) and "<" not in token:
                doc.paths.append((package, token))
    return doc


def resolve(package: str | None, token: str) -> Path:
    """Where a backticked path points: from the repository root, from weightsync/ when it
    has a folder, else (a bare ``module.py``) in the section's package."""
    if token.startswith(REPO_FOLDERS):
        return ROOT / token
    if "/" in token.rstrip("/") or package is None:
        return PACKAGE / token
    return ROOT / package / token


def defines(path: Path, name: str) -> bool:
    """Whether the module at ``path`` binds ``name`` at its top level."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                return True
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
    return False


def module_path(dotted: str) -> tuple[Path, str] | None:
    """The file of the longest module ``dotted`` starts with, and the attribute after it."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:end])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate, ".".join(parts[end:])
    return None


@pytest.fixture(scope="module")
def doc() -> Doc:
    return read_doc(DOC.read_text())


def test_every_package_has_a_section_and_every_module_listed_exists(doc: Doc) -> None:
    packages = {str(p.parent.relative_to(ROOT)) + "/" for p in PACKAGE.rglob("__init__.py")}
    assert sorted(packages - set(doc.packages)) == [], "packages with no section in docs/architecture.md"
    assert sorted(set(doc.packages) - packages) == [], "sections naming no package of the tree"
    missing = [f"{pkg}{m}" for pkg, modules in doc.packages.items() for m in modules if not (ROOT / pkg / m).is_file()]
    assert missing == [], f"docs/architecture.md lists modules that do not exist: {missing}"


def test_every_path_and_dotted_name_it_mentions_exists(doc: Doc) -> None:
    assert doc.paths and doc.links, "the reader found nothing: has the document's format changed?"
    missing = [token for package, token in doc.paths if not resolve(package, token).exists()]
    assert missing == [], f"docs/architecture.md names files or folders that do not exist: {missing}"
    unknown = []
    for dotted in doc.dotted:
        found = module_path(dotted)
        if found is None or (found[1] and ("." in found[1] or not defines(found[0], found[1]))):
            unknown.append(dotted)
    assert unknown == [], f"docs/architecture.md names modules or attributes that do not exist: {unknown}"
    broken = [link for link in doc.links if not (DOC.parent / link).is_file()]
    assert broken == [], f"docs/architecture.md links to missing documents: {broken}"


def test_the_layer_table_is_the_one_the_structure_test_enforces(doc: Doc) -> None:
    named: set[str] = set()
    wrong = []
    for number, tokens in doc.layers:
        for token in tokens:
            path = PACKAGE / token
            assert path.exists(), f"the layer table names {token}, which does not exist"
            module = module_name(path / "__init__.py" if path.is_dir() else path)
            named.add(layer_prefix(module))
            if layer(module) != number:
                wrong.append(f"{token}: layer {number} in the doc, {layer(module)} in tests/import_graph.py")
    assert wrong == [], wrong
    assert named == set(LAYERS), f"layers the table leaves out: {sorted(set(LAYERS) - named)}"
    assert [n for n, _ in doc.layers] == sorted(n for n, _ in doc.layers), "the table runs bottom up"


def test_the_reader_catches_a_missing_module_a_missing_package_and_a_wrong_layer() -> None:
    """The checks above can fail: a made-up module, section and layer are each caught."""
    text = "### `weightsync/core/`: x\n\n- `nowhere.py`: y\n\nsee `core/absent.py`\n\nlayer 6  core/  z\n"
    made_up = read_doc(text)
    assert made_up.packages == {"weightsync/core/": ["nowhere.py"]}
    assert not (ROOT / "weightsync/core/nowhere.py").exists()
    assert not resolve(None, "core/absent.py").exists()
    assert made_up.layers == [(6, ["core/"])] and layer("weightsync.core") != 6
    assert module_path("weightsync.core.registry.nothing_by_this_name") is not None
    assert not defines(PACKAGE / "core" / "registry.py", "nothing_by_this_name")
    assert defines(PACKAGE / "core" / "registry.py", "BUILTIN_TRANSPORTS")
