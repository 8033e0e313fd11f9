"""The package surface: __all__ is sorted and complete, and nothing touches CUDA on import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import sharedmem as sm


def test_all_is_sorted_and_every_name_exists() -> None:
    assert sm.__all__ == sorted(sm.__all__)
    for name in sm.__all__:
        assert hasattr(sm, name), name


def test_every_public_object_is_listed() -> None:
    module = type(sm)
    public = {n for n, v in vars(sm).items() if not n.startswith("_") and not isinstance(v, module)}
    assert public - {"annotations"} == set(sm.__all__) - {"__version__"}


def test_available_devices_starts_with_the_ones_that_always_work() -> None:
    devices = sm.available_devices()
    assert devices[:2] == ["cpu", "emulated"]
    assert all(d.startswith("cuda:") for d in devices[2:])


def test_backend_names_put_the_default_first() -> None:
    assert sm.backend_names("cpu") == ("reserved", "pageable")
    assert sm.backend_names("emulated") == ("reserved", "pageable")
    assert sm.backend_names("cuda:0") == ("vmm", "cudart", "torch")


def test_import_and_cpu_use_never_initialize_cuda() -> None:
    code = (
        "import sys, sharedmem as sm, torch\n"
        "m = sm.SyncedMemory(64, device='emulated'); m.mutable_device_data(); m.host_data()\n"
        "b = sm.Blob((4,), device='cpu'); b.mutable_data()\n"
        "assert not torch.cuda.is_initialized()\n"
        "assert 'sharedmem._backends.cuda' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _runtime_imports(path: Path, package: str) -> set[str]:
    """The sharedmem modules ``path`` imports when it runs (type-checking imports left out),
    as dotted names resolved from relative imports."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and id(node) not in typing_only and node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_no_two_modules_import_each_other() -> None:
    # A circle is dodged by an import inside a function; put the shared piece below both.
    root = Path(sm.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if parts[-1] == "__init__" else name.rpartition(".")[0]
        modules[name] = (path, package)
    imports = {
        name: _runtime_imports(path, package) & set(modules)
        for name, (path, package) in modules.items()
    }
    circles = sorted(
        (a, b)
        for a, found in imports.items()
        for b in found
        if a < b and a in imports[b] and not (b.startswith(a + ".") or a.startswith(b + "."))
    )
    assert circles == []
