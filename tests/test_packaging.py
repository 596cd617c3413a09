"""The wheel carries every subpackage and the kernels (pyproject lists them explicitly)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"(metrale(?:\.[a-z_]+)*)"', text))
    on_disk = {".".join(("metrale",) + p.parent.relative_to(ROOT / "metrale").parts)
               for p in (ROOT / "metrale").rglob("__init__.py")}
    missing = on_disk - listed
    assert not missing, f"add to [tool.setuptools] packages: {sorted(missing)}"
    assert "metrale.kernels" in listed


def test_kernels_dir_found():
    from metrale.gpu_runtime.kernel_source import kernel_files
    assert any(p.name == "argmax.cu" for p in kernel_files())


def test_native_source_ships_as_package_data():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"metrale.gpu_runtime.native" = ["*.cpp", "*.h"]' in text
    from metrale.gpu_runtime import native
    assert native.SOURCES and all(src.is_file() and src.parent.name == "native" and
                                  src.suffix in (".cpp", ".h")
                                  for src in (*native.SOURCES, *native.HEADERS))
    # every file the sources include from their own folder is one of them
    names = {src.name for src in (*native.SOURCES, *native.HEADERS)}
    for src in native.SOURCES:
        for inc in re.findall(r'#include "([^"]+)"', src.read_text()):
            assert inc in names, (src.name, inc)
