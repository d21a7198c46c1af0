"""specgraph.config: typed settings read from the environment once, changed in tests by patch."""
import re
from pathlib import Path

import pytest

from specgraph import config
from specgraph.config import Settings


def test_defaults_when_nothing_is_set():
    s = Settings.from_environ({})
    assert (s.cuda_graphs, s.whole_step, s.overlap, s.debug, s.reference_kernels) == (True, True, None, False, False)
    assert s.gguf is None and s.dump is None and s.skip_passes == frozenset() == s.skip_fast_paths
    assert s.cache == Path.home() / ".cache" / "specgraph"


def test_each_variable_is_parsed_to_its_type():
    s = Settings.from_environ({"SPECGRAPH_CUDA_GRAPHS": "0", "SPECGRAPH_OVERLAP": "1", "SPECGRAPH_DEBUG": "1",
                               "SPECGRAPH_SKIP_PASSES": " fold_rotary, fold_norms ,", "SPECGRAPH_GGUF": "/m.gguf",
                               "SPECGRAPH_CACHE": "/c", "SPECGRAPH_WHOLE_STEP": ""})
    assert s.cuda_graphs is False and s.overlap is True and s.debug is True and s.whole_step is True
    assert s.skip_passes == {"fold_rotary", "fold_norms"}
    assert s.gguf == Path("/m.gguf") and s.cache == Path("/c")
    assert Settings.from_environ({"SPECGRAPH_OVERLAP": "auto"}).overlap is None


@pytest.mark.parametrize("name, value", [("SPECGRAPH_CUDA_GRAPHS", "trees"), ("SPECGRAPH_CUDA_GRAPHS", "yes"),
                                         ("SPECGRAPH_DEBUG", "true"), ("SPECGRAPH_OVERLAP", "on"),
                                         ("SPECGRAPH_PDL", "yes")])
def test_a_bad_value_is_refused_naming_the_variable(name, value):
    with pytest.raises(ValueError, match=f"{name}='{value}'"):
        Settings.from_environ({name: value})


def test_the_environment_is_read_once(monkeypatch):
    monkeypatch.setattr(config, "_current", None)
    monkeypatch.setenv("SPECGRAPH_DEBUG", "1")
    assert config.debug is True
    monkeypatch.setenv("SPECGRAPH_DEBUG", "0")
    assert config.debug is True  # read at first use only: tests change settings through patch


def test_patch_changes_settings_for_the_block_only():
    before = config.settings()
    with config.patch(debug=True, skip_passes="fold_norms,fold_rotary", cache="/tmp/x") as inside:
        assert config.debug is True and inside.debug is True
        assert config.skip_passes == {"fold_norms", "fold_rotary"} and config.cache == Path("/tmp/x")
        with config.patch(debug=False):
            assert config.debug is False
        assert config.debug is True
    assert config.settings() is before


def test_patch_refuses_unknown_names_and_wrong_types():
    with pytest.raises(TypeError, match="no such setting"):
        with config.patch(debugg=True):
            pass
    with pytest.raises(TypeError, match=r"cuda_graphs='0'"):
        with config.patch(cuda_graphs="0"):
            pass
    with pytest.raises(TypeError, match=r"pdl='yes'"):
        with config.patch(pdl="yes"):
            pass
    with pytest.raises(AttributeError, match="no setting 'nope'"):
        config.nope


def test_only_the_config_module_reads_the_environment():
    """Every setting goes through specgraph.config: no other module of the package reads os.environ."""
    root = Path(config.__file__).parent
    readers = [str(p.relative_to(root)) for p in root.rglob("*.py")
               if p.name != "config.py" and re.search(r"os\.environ|os\.getenv|getenv\(", p.read_text())]
    assert readers == []


def test_a_dump_directory_that_cannot_be_made_is_refused_naming_the_variable(tmp_path):
    import torch

    import specgraph
    from specgraph.errors import SettingError
    from test_capture import tiny_model

    (tmp_path / "file").write_text("")
    spec = specgraph.compile(tiny_model("llama"), None, max_cache_len=32)
    with config.patch(dump=tmp_path / "file" / "dump"), pytest.raises(SettingError, match="SPECGRAPH_DUMP=.*unset it"):
        spec.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)
    with config.patch(dump=tmp_path / "dump"):
        spec.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)
    assert sorted(p.name for p in (tmp_path / "dump").iterdir())[0].startswith("00_")
