"""The C++ kernel's loader (``vit3.kernels.cpp``): processes that load it together wait for one build (a lock
on its build folder), and the one that builds says so on stderr, once; a loaded build says nothing. The builds
here are stand-ins (a real one takes a minute): the lock and the announcement are the loader's own."""

from __future__ import annotations

import threading
from pathlib import Path

from vit3.kernels import cpp


class _StandIn:
    """A build of ``library``: writes it unless it is there (as ninja would), counting the builds; the first
    one starts ``during`` (another loader) and gives it ``wait`` seconds before finishing."""

    def __init__(self, library: Path, during: threading.Thread | None = None, wait: float = 0.0) -> None:
        self.library, self.during, self.wait, self.builds = library, during, wait, 0

    def __call__(self) -> None:
        if self.library.is_file():
            return
        self.builds += 1
        during, self.during = self.during, None
        if during is not None:
            during.start()
            during.join(self.wait)  # a loader not held by the lock would build meanwhile
        self.library.write_bytes(b"built")


def test_loaders_that_start_together_wait_for_one_build(tmp_path, capsys):
    library = tmp_path / "ext.so"
    built: list[bool] = []
    second = threading.Thread(target=lambda: built.append(cpp.build_once(tmp_path, library, stand_in)))
    stand_in = _StandIn(library, during=second, wait=1.0)
    assert cpp.build_once(tmp_path, library, stand_in)
    second.join()
    assert stand_in.builds == 1 and built == [False], "the second loader waited, then loaded the build"
    assert capsys.readouterr().err.count(cpp.BUILDING) == 1


def test_a_build_says_so_and_a_loaded_build_says_nothing(tmp_path, capsys):
    library = tmp_path / "ext.so"
    stand_in = _StandIn(library)
    assert cpp.build_once(tmp_path, library, stand_in)
    assert capsys.readouterr().err == cpp.BUILDING + "\n"
    assert not cpp.build_once(tmp_path, library, stand_in)
    assert capsys.readouterr().err == "" and stand_in.builds == 1


def test_the_loader_builds_through_the_lock(tmp_path, monkeypatch, capsys):
    """``load`` stages the sources and calls PyTorch's build inside ``build_once``: announced where the folder
    has no library (a fresh ``$TORCH_EXTENSIONS_DIR``), silent where it has."""
    import torch.utils.cpp_extension as cpp_extension

    def fake_load(name: str, sources: list[str], build_directory: str, **_: object) -> None:
        assert all(Path(s).is_file() for s in sources), "staged before the build"
        (Path(build_directory) / f"{name}{cpp_extension.LIB_EXT}").write_bytes(b"built")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    cpp.load.__wrapped__()  # uncached: the process's kernel stays loaded
    assert cpp.BUILDING in capsys.readouterr().err
    cpp.load.__wrapped__()
    assert capsys.readouterr().err == ""
