"""The command line reaches other packages through their public names (issue 46, the
private boundary): a name that a package exports (its `__all__`) is imported from that
package, not from the private module that defines it."""

import ast
import importlib
from pathlib import Path

CLI = Path(__file__).resolve().parents[1] / "itde" / "cli"


def _private_imports():
    """(file, line, private module, names) of every relative import in itde/cli that
    names a private module of another package (`from ..studies._depth import ...`)."""
    for path in sorted(CLI.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                parts = ["itde", "cli"][: 3 - node.level] + (node.module or "").split(".")
                parts = [p for p in parts if p]
                if parts[:2] != ["itde", "cli"] and any(p.startswith("_") for p in parts):
                    yield path.name, node.lineno, parts, [a.name for a in node.names]


def _public_in_package(parts, names):
    """The `names` that the public package above the private module `parts` exports."""
    i = next(i for i, p in enumerate(parts) if p.startswith("_"))
    package = importlib.import_module(".".join(parts[:i]))
    return [n for n in names if n in getattr(package, "__all__", ())]


def test_the_cli_imports_public_names_from_their_package():
    found = list(_private_imports())
    assert found, "the scan sees the CLI's imports"
    bad = [(f, line, ".".join(parts), public)
           for f, line, parts, names in found
           if (public := _public_in_package(parts, names))]  # fmt: skip
    assert not bad, f"import these from their public package: {bad}"


def test_the_check_sees_a_public_name_imported_privately():
    """The rule can fail: the private path of a public name is flagged."""
    assert _public_in_package(["itde", "studies", "_depth"], ["run_depth_study"]) == [
        "run_depth_study"
    ]
    assert _public_in_package(["itde", "_solve"], ["solve", "check_depth_step"]) == ["solve"]
    assert _public_in_package(["itde", "analysis", "_common"], ["equation_of"]) == []
