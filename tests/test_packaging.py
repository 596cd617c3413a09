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


def test_license_texts_travel_with_the_code_and_the_wheel():
    """pyproject's `license = "MIT OR Apache-2.0"` needs both texts beside the code and in
    the installed distribution (PEP 639 `license-files`: .dist-info/licenses/)."""
    import importlib.metadata as md
    texts = {"LICENSE-MIT": "Permission is hereby granted, free of charge",
             "LICENSE-APACHE": "Apache License\n                           Version 2.0"}
    for name, opening in texts.items():
        assert opening in (ROOT / name).read_text()
    assert re.search(r'^license-files = \["LICENSE-MIT", "LICENSE-APACHE"\]$',
                     (ROOT / "pyproject.toml").read_text(), re.M)
    dist = md.distribution("metrale")   # this checkout, installed (CI: not editable)
    assert sorted(dist.metadata.get_all("License-File") or []) == sorted(texts)
    shipped = {Path(str(f)).name: f for f in dist.files or () if "LICENSE" in str(f)}
    for name, opening in texts.items():
        assert opening in shipped[name].read_text(), name
