"""The layer table (docs/architecture.md, "The layout is the architecture") as a test.

Every product module's imports, module-level and inside functions (``TYPE_CHECKING`` ones too: they are
arrows all the same), are resolved through ``pyproject.toml``'s package-dir mapping (the folders install
under the ``shardline`` namespace, so a path-based tool cannot see these arrows) and checked against the
table: which layer may import which. Imports within a layer are free. The folders' READMEs say the same.
"""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# layer -> the layers it may import (its own is always allowed). ``kernel`` is ``shardline/`` (and its runtimes);
# ``flows`` may import tasks and, of the kernel, only the settings and the error hierarchy (flows only wire).
MAY_IMPORT: dict[str, frozenset[str]] = {
    "kernel": frozenset(),
    "build": frozenset({"kernel"}),
    "storage": frozenset({"kernel"}),
    "quality": frozenset({"kernel", "storage", "build"}),
    "observability": frozenset({"kernel"}),
    "tasks": frozenset({"kernel", "storage", "quality", "build", "observability", "cost", "capacity"}),
    "flows": frozenset({"tasks", "settings"}),
    "online": frozenset({"kernel", "storage", "observability"}),
    "capacity": frozenset({"kernel", "storage"}),
    "controller": frozenset({"kernel", "storage"}),
    "cost": frozenset({"kernel", "storage", "capacity"}),
    "cli": frozenset({"kernel", "build", "storage", "quality", "observability", "tasks", "flows", "online",
                      "capacity", "controller", "cost"}),
}
KERNEL_FOR_FLOWS = ("shardline.settings", "shardline.errors")  # what "settings" means for a flow
# Third-party packages a layer never imports: slow to import, not needed on a request path (online), or not
# installed beside it (the kernel runs on Dask workers and in replicas without Prefect).
NEVER: dict[str, tuple[str, ...]] = {
    "online": ("prefect", "great_expectations", "dask", "distributed"),
    "kernel": ("prefect", "great_expectations"),
    "storage": ("prefect", "great_expectations"),
    "build": ("prefect",),
    "observability": ("prefect", "great_expectations", "dask", "distributed"),
}


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    layer: str


def _mapping() -> dict[str, Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {package: ROOT / folder for package, folder in config["tool"]["setuptools"]["package-dir"].items()}


def _layer(package: str) -> str:
    parts = package.split(".")
    return "kernel" if len(parts) == 1 else parts[1]


def product_modules() -> dict[str, Module]:
    """Every module of the product: its dotted name (as installed), file and layer."""
    mapping = _mapping()
    folders = sorted(mapping.items(), key=lambda item: len(item[1].parts), reverse=True)
    modules: dict[str, Module] = {}
    for package, folder in mapping.items():
        for path in sorted(folder.rglob("*.py")):
            owner = next(p for p, f in folders if path.is_relative_to(f))  # the deepest mapped folder holds it
            if owner != package:
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            modules[name] = Module(name, path, _layer(package))
    return modules


def imports_of(module: Module) -> list[tuple[str, int]]:
    """(the dotted name imported, line) for every import statement in the module, relative ones resolved."""
    package = module.name if module.path.name == "__init__.py" else module.name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(module.path.read_text(), str(module.path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.append((source, node.lineno))
            found += [(f"{source}.{alias.name}", node.lineno) for alias in node.names]
    return found


def _target(name: str, modules: dict[str, Module]) -> Module | None:
    while name:
        if name in modules:
            return modules[name]
        name = name.rpartition(".")[0]
    return None


def violations(modules: dict[str, Module]) -> list[str]:
    """Every import the table does not allow, as ``file:line: a (layer) imports b (layer)``."""
    found = set()
    for module in modules.values():
        allowed = MAY_IMPORT[module.layer] | {module.layer}
        for name, line in imports_of(module):
            where = f"{module.path.relative_to(ROOT)}:{line}"
            top = name.split(".")[0]
            if top in NEVER.get(module.layer, ()):
                found.add(f"{where}: {module.name} ({module.layer}) imports {top}, which it never may")
            target = _target(name, modules)
            if target is None or target.layer in allowed or target is module:
                continue
            if module.layer == "flows" and target.name.startswith(KERNEL_FOR_FLOWS):
                continue
            found.add(f"{where}: {module.name} ({module.layer}) imports {target.name} ({target.layer})")
    return sorted(found)


def test_every_folder_is_a_layer_of_the_table() -> None:
    assert {_layer(package) for package in _mapping()} == set(MAY_IMPORT)


def test_every_import_follows_the_layer_table() -> None:
    found = violations(product_modules())
    assert not found, "imports the layer table does not allow:\n" + "\n".join(found)


def test_a_planted_upward_import_is_caught(tmp_path: Path) -> None:
    """The test would see an arrow the table forbids: the kernel's errors importing a task, a relative import
    out of storage into the CLI."""
    modules = product_modules()
    kernel = tmp_path / "errors.py"
    kernel.write_text("from shardline.tasks.batch import run_shard\n")
    storage = tmp_path / "fs.py"
    storage.write_text("def f():\n    from ..cli import main\n")
    planted = {**modules, "shardline.errors": Module("shardline.errors", kernel, "kernel"),
               "shardline.storage.fs": Module("shardline.storage.fs", storage, "storage")}
    found = [v.split(": ", 1)[1] for v in violations_at(planted, tmp_path)]
    assert "shardline.errors (kernel) imports shardline.tasks.batch (tasks)" in found
    assert "shardline.storage.fs (storage) imports shardline.cli (cli)" in found


def violations_at(modules: dict[str, Module], root: Path) -> list[str]:
    """``violations`` for modules some of which live outside the repository (a planted copy)."""
    global ROOT
    saved, ROOT = ROOT, Path("/")
    try:
        return violations(modules)
    finally:
        ROOT = saved


# How the READMEs and docs/architecture.md name a layer: `shardline` is the kernel, `shardline.storage`,
# `storage` and `storage/` the storage layer; `shardline.settings` and `shardline.errors` what a flow may read.
def _layers_named(text: str) -> set[str]:
    if text.strip().startswith("anything"):
        return set(MAY_IMPORT) - {"cli"}
    named = set()
    for word in re.findall(r"`([\w./]+)`", text):
        word = word.rstrip("/")
        if word in KERNEL_FOR_FLOWS:
            named.add("settings")
        elif word == "shardline":
            named.add("kernel")
        elif word.removeprefix("shardline.") in MAY_IMPORT:
            named.add(word.removeprefix("shardline."))
    return named


def _folder_of(layer: str) -> str:
    return "shardline" if layer == "kernel" else layer


def _readme_may_import(folder: str) -> str:
    """The first sentence of the README's "May import:" line (what follows it is free prose)."""
    text = (ROOT / folder / "README.md").read_text()
    assert "May import:" in text, f"{folder}/README.md has no \"May import:\" line"
    return re.split(r"\.(?:\s|$)", text.split("May import:", 1)[1], maxsplit=1)[0]


@pytest.mark.parametrize("layer", sorted(MAY_IMPORT))
def test_each_folders_readme_says_what_it_may_import(layer: str) -> None:
    """The README's "May import:" sentence names exactly the layers the table allows ("anything" for the CLI)."""
    sentence = _readme_may_import(_folder_of(layer))
    assert _layers_named(sentence) == set(MAY_IMPORT[layer]), f"{_folder_of(layer)}/README.md: {sentence!r}"
    if not MAY_IMPORT[layer]:
        assert "third-party libraries only" in sentence


def test_the_architecture_table_says_what_the_test_holds() -> None:
    rows = re.findall(r"^\| `(\w+)` \| (.+) \|$", (ROOT / "docs" / "architecture.md").read_text(), re.M)
    table = {("kernel" if folder == "shardline" else folder): _layers_named(allowed) for folder, allowed in rows
             if "may import" not in allowed and ("kernel" if folder == "shardline" else folder) in MAY_IMPORT}
    assert table == {layer: set(allowed) for layer, allowed in MAY_IMPORT.items()}
