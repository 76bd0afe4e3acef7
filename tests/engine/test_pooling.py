"""Reading how a sentence-transformers checkpoint pools (engine/pooling.py): what the engine
reproduces, and a clear refusal of what it cannot."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.demo_model import write_sentence_transformers_files
from engine.pooling import CLS, LAST, MEAN, Pooling, read_max_seq_length, read_pooling

TRANSFORMER = {"idx": 0, "name": "0", "path": "",
               "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling",
           "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize",
             "type": "sentence_transformers.models.Normalize"}


def checkpoint(folder: Path, modules: list[dict], pooling: dict) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return folder


def test_a_checkpoint_without_modules_json_is_no_embedding_model(tiny_model_dir):
    assert read_pooling(tiny_model_dir) is None
    assert read_max_seq_length(tiny_model_dir) is None


@pytest.mark.parametrize("pooling, mode", [("mean", MEAN), ("cls", CLS), ("lasttoken", LAST)])
@pytest.mark.parametrize("normalize", [True, False])
def test_the_demo_builders_files_read_back_as_written(tmp_path, pooling, mode, normalize):
    (tmp_path / "config.json").write_text(json.dumps(
        {"hidden_size": 64, "max_position_embeddings": 512}))
    write_sentence_transformers_files(tmp_path, pooling=pooling, normalize=normalize)
    assert read_pooling(tmp_path) == Pooling(mode, normalize)
    assert read_max_seq_length(tmp_path) == 512


@pytest.mark.parametrize("config, mode", [
    ({"pooling_mode": "lasttoken"}, LAST),  # sentence-transformers 6's own layout
    ({"pooling_mode": ["cls"]}, CLS),
    ({"pooling_mode_mean_tokens": False}, MEAN),  # no mode set: sentence-transformers' default
])
def test_either_layout_of_the_pooling_config_is_read(tmp_path, config, mode):
    assert read_pooling(checkpoint(tmp_path, [TRANSFORMER, POOLING], config)) == \
        Pooling(mode, normalize=False)


@pytest.mark.parametrize("modules, config, message", [
    ([TRANSFORMER, POOLING, {"idx": 2, "path": "2_Dense",
                             "type": "sentence_transformers.models.Dense"}],
     {"pooling_mode": "mean"}, "modules Dense are not supported"),
    ([TRANSFORMER], {}, "must list one Pooling module"),
    ([POOLING, TRANSFORMER], {}, "the first module must be the Transformer"),
    ([TRANSFORMER, NORMALIZE, POOLING], {}, "Normalize must come after Pooling"),
    ([TRANSFORMER, POOLING], {"pooling_mode": "max"}, "pooling mode 'max' is not supported"),
    ([TRANSFORMER, POOLING], {"pooling_mode_max_tokens": True},
     "pooling modes pooling_mode_max_tokens are not supported"),
    ([TRANSFORMER, POOLING], {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True},
     "several modes"),
])
def test_what_the_engine_cannot_reproduce_is_refused_by_name(tmp_path, modules, config, message):
    with pytest.raises(ValueError, match=message):
        read_pooling(checkpoint(tmp_path, modules, config))


def test_an_embedding_engine_refuses_to_start_on_a_pooling_it_cannot_reproduce(
        tmp_path, tiny_model_dir):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    folder = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    checkpoint(folder, [TRANSFORMER, POOLING], {"pooling_mode": "weightedmean"})
    with pytest.raises(ValueError, match="pooling mode 'weightedmean' is not supported"):
        LLMEngine(EngineConfig(model_dir=folder, num_kv_blocks=8))
