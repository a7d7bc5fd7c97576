"""Every ``from shardline.X import y`` in the repository (product, tests, bench; inside functions too) names a
module and a name that exist. Type checking alone did not catch a name removed from a module that another module
imported from it (a re-export that a linter's autofix took away), so this test imports each one, in a process of
its own (the imports must not leak into the test session)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("shardline", "build", "storage", "quality", "observability", "capacity", "controller", "cost", "tasks",
           "flows", "online", "cli", "tests", "bench")

CHECK = r"""
import ast, importlib, sys
from pathlib import Path
root = Path(sys.argv[1]); bad = []
for folder in sys.argv[2:]:
    for path in sorted((root / folder).rglob("*.py")):
        if any(part.startswith(".") for part in path.relative_to(root).parts):
            continue  # git-ignored: bench/.peers holds peers' own environments (vLLM's, guidellm's), bench/.data data
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("shardline")):
                continue
            where = f"{path.relative_to(root)}:{node.lineno}"
            try:
                module = importlib.import_module(node.module)
            except Exception as e:
                bad.append(f"{where}: {node.module} does not import ({type(e).__name__}: {e})")
                continue
            for alias in node.names:
                if alias.name != "*" and not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        bad.append(f"{where}: {node.module} has no {alias.name}")
print("\n".join(bad))
"""


def test_every_shardline_import_names_what_exists() -> None:
    done = subprocess.run([sys.executable, "-c", CHECK, str(ROOT), *FOLDERS], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    missing = [line for line in done.stdout.splitlines() if line.strip()]
    assert not missing, "imports of names that do not exist:\n" + "\n".join(missing)
