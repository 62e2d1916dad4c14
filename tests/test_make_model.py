"""Offline model/tokenizer maker: HF-loadable tokenizer, byte-level round trips, default model."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from tidal.frontend.entrypoints import make_model as mm


@pytest.fixture(autouse=True, scope="module")
def _cache(tmp_path_factory: pytest.TempPathFactory) -> Any:
    # One cache for the module (tokenizers train once), never the user's ~/.cache/tidal.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", str(tmp_path_factory.mktemp("make-model-cache")))
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return mm.make_model(str(tmp_path_factory.mktemp("qwen3")), "qwen3", max_shard_size="40KB")


TEXTS = [
    "def main() -> None:\n    print('hello, world')\n",
    "Ünïcödé — ça marche? 日本語のテキスト、中文文本。 한국어",
    "emoji 🎉🚀👩‍👩‍👧 and tabs\t\tand  double  spaces\n\n",
    "<|im_start|>user\nhi<|im_end|>",
]


def test_tokenizer_round_trip(model_dir: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == 512
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token_id == 0 and tok.bos_token_id == 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert all(0 <= i < 512 for i in ids)
        assert tok.decode(ids) == text
    # special tokens are single ids and can be skipped
    ids = tok.encode(TEXTS[3], add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") == 1
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"
    # no BOS/EOS added implicitly: the engine sees exactly the prompt's tokens
    assert tok.encode("abc") == tok.encode("abc", add_special_tokens=False)


def test_chat_template(model_dir: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 👋<|im_end|>\n<|im_start|>assistant\n"
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        assert "<|im_start|>" in json.load(f)["chat_template"]

    # as the server calls it (vLLM's way): the prompt a chat request becomes
    hi = [{"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(hi, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(hi, tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"
    # round trip: the markers are single special ids (<|im_start|> 1, <|im_end|> = EOS 2)
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids.count(1) == 2 and ids.count(2) == 1 and ids[0] == 1
    assert tok.decode(ids) == prompt
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi\nassistant\n"
    assert list(tok.apply_chat_template(hi, add_generation_prompt=True, return_dict=False)) == ids


def test_checkpoint_files_and_configs(model_dir: str, tmp_path: Any) -> None:
    from transformers import AutoConfig, GenerationConfig

    files = set(os.listdir(model_dir))
    assert {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors.index.json"} <= files
    assert sum(f.endswith(".safetensors") for f in files) > 1  # sharded
    cfg = AutoConfig.from_pretrained(model_dir)
    assert cfg.architectures == ["Qwen3ForCausalLM"] and cfg.tie_word_embeddings
    assert cfg.eos_token_id == 2
    assert GenerationConfig.from_pretrained(model_dir).eos_token_id == 2

    # same seed -> identical weights; tokenizer copied from another model dir
    from safetensors.torch import load_file

    a = mm.make_model(str(tmp_path / "a"), "llama", seed=3)
    b = mm.make_model(str(tmp_path / "b"), "llama", seed=3, tokenizer_dir=model_dir)
    wa, wb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert "lm_head.weight" in wa  # llama defaults to untied
    with pytest.raises(ValueError):
        mm.make_model(str(tmp_path / "c"), "gpt2")


def test_default_model_made_once(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from tidal.worker.loader import load_model

    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    assert mm.default_model_dir() == str(tmp_path / "cache" / "default-model")
    path = mm.ensure_default_model()
    assert path == mm.default_model_dir()
    stamp = os.stat(os.path.join(path, "config.json")).st_mtime_ns
    assert mm.ensure_default_model() == path
    assert os.stat(os.path.join(path, "config.json")).st_mtime_ns == stamp  # not rebuilt
    assert [p for p in os.listdir(tmp_path / "cache") if p.startswith(".default-model-")] == []

    cfg = AutoConfig.from_pretrained(path)
    assert cfg.architectures == [mm.DEFAULT_ARCH.capitalize() + "ForCausalLM"]
    assert len(AutoTokenizer.from_pretrained(path)) == cfg.vocab_size
    model = load_model(path, cfg, torch.float32)
    with torch.no_grad():
        logits = model.compute_logits(model(torch.tensor([5, 6, 7]), torch.arange(3)))
    assert logits.shape == (3, cfg.vocab_size) and torch.isfinite(logits).all()

    monkeypatch.delenv("TIDAL_CACHE_DIR")
    assert mm.default_model_dir() == os.path.join(os.path.expanduser("~"), ".cache", "tidal", "default-model")
