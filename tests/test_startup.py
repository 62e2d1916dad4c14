"""Start-up paths that skip transformers: the front-end's LeanTokenizer (checked against
transformers' own tokenizer of the same directory), the worker's plain config.json reader
(checked against AutoConfig), and the lazily zeroed KV cache."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from tidal.frontend.tokenizer import LeanTokenizer, load_lean_tokenizer
from tidal.worker.hf_config import READ_FIELDS, load_hf_config

TEXTS = [
    "Hello, my name is",
    "",
    " leading and  double  spaces\tand\ttabs\n\nnewlines",
    "def f(x):\n    return x ** 2  # comment",
    "unicode: héllo wörld ✓ 日本語 🙂",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "a<|im_end|>b <|im_start|> c",
]


@pytest.fixture(scope="module", autouse=True)
def verdict_cache(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Tokenizer verdicts (frontend/tokenizer_verdict.py) of this module stay out of ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", str(tmp_path_factory.mktemp("verdicts")))
        yield


@pytest.fixture(scope="module")
def hf_tok(tiny_model_dir: str):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def lean(tiny_model_dir: str, hf_tok) -> LeanTokenizer:  # type: ignore[no-untyped-def]
    first = load_lean_tokenizer(tiny_model_dir, load_full=lambda: hf_tok)  # judged, and cached
    assert isinstance(first, LeanTokenizer)
    tok = load_lean_tokenizer(tiny_model_dir, load_full=lambda: pytest.fail("the full tokenizer was loaded"))
    assert isinstance(tok, LeanTokenizer)
    return tok


def test_lean_tokenizer_encodes_and_decodes_as_transformers(lean: LeanTokenizer, hf_tok) -> None:  # type: ignore[no-untyped-def]
    for text in TEXTS:
        for special in (True, False):
            assert lean.encode(text, add_special_tokens=special) == hf_tok.encode(text, add_special_tokens=special)
        ids = hf_tok.encode(text)
        for skip in (True, False):
            assert lean.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)
        assert lean.convert_ids_to_tokens(ids) == hf_tok.convert_ids_to_tokens(ids)
        assert lean.convert_tokens_to_ids(hf_tok.convert_ids_to_tokens(ids)) == ids
    every_id = list(range(len(hf_tok)))
    assert lean.decode(every_id) == hf_tok.decode(every_id)
    assert lean.decode(5) == hf_tok.decode(5)


def test_lean_tokenizer_attributes_match_transformers(lean: LeanTokenizer, hf_tok) -> None:  # type: ignore[no-untyped-def]
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id",
                 "pad_token_id", "unk_token_id", "vocab_size", "chat_template", "model_max_length"):
        assert getattr(lean, name) == getattr(hf_tok, name), name
    assert len(lean) == len(hf_tok)
    assert lean.get_vocab() == hf_tok.get_vocab()
    assert sorted(lean.all_special_ids) == sorted(hf_tok.all_special_ids)


def test_lean_tokenizer_hands_the_rest_to_transformers(tiny_model_dir: str, hf_tok, lean) -> None:  # type: ignore[no-untyped-def]
    loads: list[int] = []  # the verdict is cached (the lean fixture): nothing loaded up front

    def load_full():  # type: ignore[no-untyped-def]
        loads.append(1)
        return hf_tok

    tok = load_lean_tokenizer(tiny_model_dir, load_full)
    assert tok is not None and not loads
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok("hello")["input_ids"] == hf_tok("hello")["input_ids"]
    assert tok.padding_side == hf_tok.padding_side  # an attribute only transformers' class has
    assert loads == [1]  # loaded once, on first need


def _copy(src: str, dst: str, edit_config=None) -> str:  # type: ignore[no-untyped-def]
    shutil.copytree(src, dst)
    if edit_config is not None:
        path = os.path.join(dst, "tokenizer_config.json")
        with open(path) as f:
            cfg = json.load(f)
        edit_config(cfg)
        with open(path, "w") as f:
            json.dump(cfg, f)
    return dst


@pytest.mark.parametrize("edit", [
    lambda c: c.update(tokenizer_class="Qwen2Tokenizer"),  # a class that rebuilds the pre-tokenizer
    lambda c: c.update(add_prefix_space=True),
    lambda c: c.update(split_special_tokens=True),
    lambda c: c.update(eos_token="<|not-in-vocab|>"),  # transformers adds a token
    lambda c: c.update(add_bos_token=True),
    lambda c: [c.pop("add_bos_token"), c.pop("add_eos_token")],
])
def test_lean_tokenizer_follows_what_transformers_builds(tiny_model_dir: str, tmp_path, edit) -> None:  # type: ignore[no-untyped-def]
    """Where the tokenizer class or config changes the file's pipeline, the lean tokenizer runs
    what transformers runs, from the cached verdict on, without transformers."""
    from transformers import AutoTokenizer

    path = _copy(tiny_model_dir, str(tmp_path / "m"), edit)
    hf = AutoTokenizer.from_pretrained(path)
    assert isinstance(load_lean_tokenizer(path, load_full=lambda: hf), LeanTokenizer)
    lean = load_lean_tokenizer(path, load_full=lambda: pytest.fail("the full tokenizer was loaded"))
    assert isinstance(lean, LeanTokenizer) and len(lean) == len(hf) and lean.eos_token == hf.eos_token
    for text in TEXTS:
        for special in (True, False):
            assert lean.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
        ids = hf.encode(text)
        assert lean.decode(ids) == hf.decode(ids)


def _subclass_with_own_encode(hf):  # type: ignore[no-untyped-def]
    """transformers' tokenizer, but of a class with Python of its own in encode."""
    cls = type("OwnEncode", (type(hf),), {"encode": lambda self, text, **kw: [0]})
    hf.__class__ = cls
    return hf


@pytest.mark.parametrize("case", ["not transformers' fast class", "own encode", "remote code", "truncation"])
def test_lean_tokenizer_declines_what_it_does_not_reproduce(tiny_model_dir: str, tmp_path, monkeypatch,  # type: ignore[no-untyped-def]
                                                            case: str) -> None:
    from transformers import AutoTokenizer

    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))  # no verdict from another test

    path = _copy(tiny_model_dir, str(tmp_path / "m"),
                 (lambda c: c.update(auto_map={"AutoTokenizer": ["x.Y", None]})) if case == "remote code" else None)
    if case == "truncation":
        file = os.path.join(path, "tokenizer.json")
        with open(file) as f:
            spec = json.load(f)
        spec["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
        with open(file, "w") as f:
            json.dump(spec, f)
    full = {"not transformers' fast class": lambda: object(),
            "own encode": lambda: _subclass_with_own_encode(AutoTokenizer.from_pretrained(tiny_model_dir))}.get(
                case, lambda: AutoTokenizer.from_pretrained(path, trust_remote_code=False))
    assert load_lean_tokenizer(path, load_full=full) is None
    assert load_lean_tokenizer(path, load_full=full) is None  # a refusal is not cached as a pass


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_plain_config_reads_as_autoconfig(tidal_cache_dir: str, tmp_path, arch: str) -> None:  # type: ignore[no-untyped-def]
    from tidal.frontend.entrypoints.make_model import make_model
    from tidal.worker.layers.rotary import rope_params_from_config
    from tidal.worker.loader import resolve_dtype

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", tidal_cache_dir)
        path = make_model(str(tmp_path / arch), arch=arch, vocab_size=512, hidden_size=64, num_layers=1)
    plain, auto = load_hf_config(path), load_hf_config(path, allow_plain=False)
    assert type(plain).__name__ == "SimpleNamespace"
    for field in READ_FIELDS:
        assert getattr(plain, field, None) == getattr(auto, field, None), field
    assert rope_params_from_config(plain) == rope_params_from_config(auto)
    assert resolve_dtype("auto", plain) == resolve_dtype("auto", auto)


def test_plain_config_defers_to_autoconfig_when_a_default_matters(tiny_model_dir: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "m")
    shutil.copytree(tiny_model_dir, path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    del cfg["head_dim"]  # Qwen3Config's default (128) is not hidden_size // heads
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    got = load_hf_config(path)
    assert type(got).__name__ == "Qwen3Config" and got.head_dim == 128


def test_zeroed_kv_tensor() -> None:
    from tidal.worker.model_runner import zeroed_kv_tensor

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = zeroed_kv_tensor((7, 16, 2, 64), dtype, torch.device("cpu"))
        assert t.shape == (7, 16, 2, 64) and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % 64 == 0 and not t.any()
        t[3, 5] = 1  # writable, and a view of nothing else
        assert int(t.count_nonzero()) == 2 * 64
