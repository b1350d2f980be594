"""``_after_import.when_imported``: a spawned worker sets torch up as torch's import completes
(tests/test_workers.py runs it with torch under spawn); here its rules on modules of our own."""

from __future__ import annotations

import importlib
import sys

import pytest

from arena_loader._after_import import when_imported


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """A directory on sys.path to write modules into; they and the hooks go afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    meta_path = list(sys.meta_path)
    before = set(sys.modules)
    yield tmp_path
    sys.meta_path[:] = meta_path
    for name in set(sys.modules) - before:
        del sys.modules[name]
    importlib.invalidate_caches()


def test_the_callback_runs_once_as_the_import_completes(modules):
    (modules / "later_mod.py").write_text(
        "VALUE = 7\nimport sys\nSEEN = 'later_mod' in sys.modules\n")
    calls = []
    when_imported("later_mod", lambda module: calls.append((module.VALUE, module.SEEN)))
    assert calls == []  # nothing imported it yet
    import later_mod

    assert calls == [(7, True)]  # after the module ran, before the importer got it
    loader = later_mod.__spec__.loader
    assert "exec_module" not in vars(loader)  # the loader's own method again
    loader.exec_module(later_mod)  # (run again by hand: no callback)
    importlib.reload(later_mod)
    import later_mod as again  # noqa: F401
    assert calls == [(7, True)]  # once
    assert not any(type(finder).__name__ == "_AfterImport" for finder in sys.meta_path)


def test_a_module_already_loaded_gets_the_callback_now(modules):
    (modules / "loaded_mod.py").write_text("VALUE = 3\n")
    import loaded_mod

    calls = []
    when_imported("loaded_mod", lambda module: calls.append(module))
    assert calls == [loaded_mod]
    assert not any(type(finder).__name__ == "_AfterImport" for finder in sys.meta_path)


def test_other_imports_and_submodules_pass_through(modules):
    (modules / "pkg_mod").mkdir()
    (modules / "pkg_mod" / "__init__.py").write_text("from . import sub\n")
    (modules / "pkg_mod" / "sub.py").write_text("X = 1\n")
    (modules / "other_mod.py").write_text("Y = 2\n")
    calls = []
    when_imported("pkg_mod", lambda module: calls.append(module.sub.X))
    import other_mod

    assert other_mod.Y == 2 and calls == []
    import pkg_mod.sub  # noqa: F401

    assert calls == [1]  # the package's own import of its submodule done first


def test_an_import_that_raises_runs_no_callback_and_leaves_the_loader_as_it_was(modules):
    (modules / "broken_mod.py").write_text("raise ImportError('broken here')\n")
    calls = []
    when_imported("broken_mod", calls.append)
    with pytest.raises(ImportError, match="broken here"):
        import broken_mod
    assert calls == []
    with pytest.raises(ImportError, match="broken here"):  # imported again: a plain import
        import broken_mod  # noqa: F401
    assert calls == []


def test_a_module_that_does_not_exist_is_a_plain_import_error(modules):
    calls = []
    when_imported("no_such_mod_here", calls.append)
    with pytest.raises(ModuleNotFoundError):
        import no_such_mod_here  # noqa: F401
    assert calls == []
