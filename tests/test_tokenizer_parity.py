"""The front-end's prompt token ids and decoded text equal `transformers.AutoTokenizer`'s, for
every model type tidal serves, including checkpoints whose tokenizer.json is not what
transformers builds for that model type (its tokenizer class rebuilds the pipeline).

The reference is AutoTokenizer at run time (no expected ids are written down here); tidal's side
goes through `engine_setup.load_tokenizer` and the InputProcessor, as `LLM`/`AsyncLLM` do, once
with no cached verdict and once with it (frontend/tokenizer.py)."""
from __future__ import annotations

import glob
import json
import os
import random
import shutil
import subprocess
import sys
from typing import Any, Callable, Iterator

import pytest

from tidal.frontend.detokenizer import IncrementalDetokenizer
from tidal.frontend.engine_setup import load_tokenizer
from tidal.frontend.input_processor import InputProcessor
from tidal.frontend.entrypoints.make_model import training_corpus
from tidal.frontend.tokenizer import LeanTokenizer, load_lean_tokenizer
from tidal.protocol.config import SUPPORTED_ARCHITECTURES, EngineConfig
from tidal.protocol.messages import EngineCoreRequest
from tidal.protocol.sampling_params import SamplingParams

MAX_LEN = 1 << 16
TEXTS = [
    "",
    " ",
    "Hello, my name is",
    "        self.pos = 0\n",
    "class A:\n    def f(self):\n        if x:\n            for i in range(10):\n                "
    "while True:\n                    return {'k': [1, 2, 3]}\n",
    "\t\tindented\twith\ttabs\t\n\t",
    "digits 0 7 42 1234567890 3.14159 -12,345.60 2024-01-31 0x1F 1e-9 ٣٤ ５６",
    "unicode: héllo wörld ✓ café (e\u0301 combining) ﬁ ligature Å",
    "日本語のテキスト。中文文本测试，한국어 텍스트",
    "emoji 😀🎉👍🏽 👨‍👩‍👧 🇫🇷 done",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "a<|im_end|>b <|im_start|> c<|endoftext|>d",
    "<s>[INST] hi [/INST]</s> <unk> < s>",
    "trailing spaces   ",
    "runs of newlines\n\n\n\n\nand\r\n\r\nwindows",
    "   leading spaces and   inner    runs      ",
    "▁ metaspace ▁▁ literal Ġ and bytes <0x41>",
    "don't it's we've I'm you're they'll he'd . , ! ? ; :",
    "x" * 300 + " " + "ab" * 100,
]
# Model type (config.json) -> make_model arch.
ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
         "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
         "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe", "Phi3ForCausalLM": "phi3",
         "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
         "Gemma3ForConditionalGeneration": "gemma3",  # its language model is gemma3's
         # gpt-oss ships a byte-level BPE tokenizer.json under PreTrainedTokenizerFast, which
         # transformers loads as written for model_type gpt_oss: make_model's qwen3 files' case.
         "GptOssForCausalLM": "qwen3"}
SP_SPECIALS = ["<unk>", "<s>", "</s>"]


def sentencepiece_tokenizer_json(path: str) -> None:
    """A Llama-2-style tokenizer.json (BPE with byte fallback over <0xNN> tokens, Metaspace),
    written the way a hand-converted checkpoint might: prefix "always", split on spaces, no
    Strip decoder, no post-processor -- not what LlamaTokenizer builds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = training_corpus(150_000)
    texts.append("日本語のテキスト。中文文本测试。😀🎉 héllo 0123456789 " * 10)
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=500, special_tokens=SP_SPECIALS,
                                                       show_progress=False))
    spec = json.loads(tok.to_str())
    # The 256 byte tokens as ordinary vocabulary entries right after the specials, as in Llama 2.
    trained = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]) if t not in SP_SPECIALS]
    order = SP_SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + trained
    spec["model"]["vocab"] = {t: i for i, t in enumerate(order)}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)


def _edit(path: str, name: str, edit: Callable[[dict[str, Any]], None]) -> None:
    file = os.path.join(path, name)
    with open(file, encoding="utf-8") as f:
        data = json.load(f)
    edit(data)
    with open(file, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)


def _sentencepiece_variant(dst: str, sp_json: str, tokenizer_class: str, add_bos: bool) -> None:
    shutil.copyfile(sp_json, os.path.join(dst, "tokenizer.json"))

    def config(c: dict[str, Any]) -> None:
        c.update(tokenizer_class=tokenizer_class, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                 pad_token=None, added_tokens_decoder={}, additional_special_tokens=[], add_bos_token=add_bos)
    _edit(dst, "tokenizer_config.json", config)
    with open(os.path.join(dst, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, f)


@pytest.fixture(scope="module")
def verdict_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """TIDAL_CACHE_DIR for this module: verdicts never land in the user's ~/.cache/tidal."""
    path = str(tmp_path_factory.mktemp("tokenizer-verdicts"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", path)
        yield path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tidal_cache_dir: str,
                verdict_cache: str) -> dict[str, str]:
    """name -> checkpoint dir: each model type as make_model writes it, plus variants whose
    tokenizer files transformers turns into another pipeline."""
    from tidal.frontend.entrypoints.make_model import make_model

    root = tmp_path_factory.mktemp("parity")
    dirs: dict[str, str] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", tidal_cache_dir)  # the session's trained byte-level BPE
        for arch in sorted(set(ARCHS.values())):
            dirs[arch] = make_model(str(root / arch), arch=arch, vocab_size=512, hidden_size=32,
                                    num_layers=1, num_heads=2, num_kv_heads=1)
    sp_json = str(root / "sentencepiece.json")
    sentencepiece_tokenizer_json(sp_json)

    def variant(name: str, base: str) -> str:
        dirs[name] = str(root / name)
        shutil.copytree(dirs[base], dirs[name])
        return dirs[name]

    # LlamaTokenizer rebuilds pre-tokenizer (prefix "first", no split), decoder (Strip), BOS.
    _sentencepiece_variant(variant("llama-sentencepiece", "llama"), sp_json, "LlamaTokenizerFast", True)
    # Llama-3 style: byte-level under LlamaTokenizerFast, clean_up_tokenization_spaces on.
    _edit(variant("llama-cleanup", "llama"), "tokenizer_config.json",
          lambda c: c.update(tokenizer_class="LlamaTokenizerFast", clean_up_tokenization_spaces=True))
    # Mistral-7B style: declares LlamaTokenizer, loads as TokenizersBackend, which adds a
    # post-processor the file lacks.
    _sentencepiece_variant(variant("mistral-sentencepiece", "mistral"), sp_json, "LlamaTokenizer", True)
    # Mixtral-8x7B ships Mistral's tokenizer files; Qwen3-MoE declares Qwen2Tokenizer as Qwen3 does.
    _sentencepiece_variant(variant("mixtral-sentencepiece", "mixtral"), sp_json, "LlamaTokenizer", True)
    _edit(variant("qwen3_moe-qwen2-class", "qwen3_moe"), "tokenizer_config.json",
          lambda c: c.update(tokenizer_class="Qwen2Tokenizer"))
    # Phi-3 ships Llama 2's sentencepiece tokenizer under LlamaTokenizer, add_bos_token false.
    _sentencepiece_variant(variant("phi3-sentencepiece", "phi3"), sp_json, "LlamaTokenizer", False)
    # Gemma 2 and 3 declare GemmaTokenizer (sentencepiece, BOS added).
    _sentencepiece_variant(variant("gemma2-sentencepiece", "gemma2"), sp_json, "GemmaTokenizer", True)
    _sentencepiece_variant(variant("gemma3-sentencepiece", "gemma3"), sp_json, "GemmaTokenizer", True)
    # qwen2 as make_model writes it is the reported case (Qwen2Tokenizer splits every digit).
    _edit(variant("qwen3-qwen2-class", "qwen3"), "tokenizer_config.json",
          lambda c: c.update(tokenizer_class="Qwen2Tokenizer"))
    _edit(variant("qwen3-split-special", "qwen3"), "tokenizer_config.json",
          lambda c: c.update(split_special_tokens=True))
    return dirs


NAMES = ["llama", "llama-sentencepiece", "llama-cleanup", "mistral", "mistral-sentencepiece", "qwen2",
         "qwen3", "qwen3-qwen2-class", "qwen3-split-special", "mixtral", "mixtral-sentencepiece", "qwen3_moe",
         "qwen3_moe-qwen2-class", "phi3", "phi3-sentencepiece", "gemma2", "gemma2-sentencepiece", "gemma3",
         "gemma3-sentencepiece"]


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, str]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(path) for name, path in checkpoints.items()}


def _pipeline(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k not in ("truncation", "padding")}


def test_every_model_type_has_a_checkpoint_transformers_rebuilds(checkpoints: dict[str, str],
                                                                 references: dict[str, Any]) -> None:
    """Guards the corpus: per supported model type, one checkpoint whose tokenizer.json is not
    the pipeline AutoTokenizer runs (else the parity tests below could pass by accident)."""
    assert set(SUPPORTED_ARCHITECTURES) == set(ARCHS)
    rebuilt = set()
    for name, path in checkpoints.items():
        with open(os.path.join(path, "tokenizer.json"), encoding="utf-8") as f:
            spec = json.load(f)
        if _pipeline(spec) != _pipeline(json.loads(references[name]._tokenizer.to_str())):
            rebuilt.add(name.split("-")[0])
    assert rebuilt == set(ARCHS.values())


def _front_end(path: str) -> tuple[Any, InputProcessor]:
    tok = load_tokenizer(EngineConfig(model=path))
    return tok, InputProcessor(tok, max_model_len=MAX_LEN, vocab_size=len(tok), max_logprobs=5)


@pytest.mark.parametrize("name", NAMES)
def test_prompt_token_ids_match_autotokenizer(checkpoints: dict[str, str], references: dict[str, Any],
                                              name: str) -> None:
    hf = references[name]
    for load in ("first", "cached verdict"):
        tok, ip = _front_end(checkpoints[name])
        for i, text in enumerate(TEXTS):
            if hf.encode(text):  # an empty prompt is refused
                request, _ = ip.process(f"r{i}", text, SamplingParams(max_tokens=1))
                assert request.prompt_token_ids == hf.encode(text), (load, text)
            assert tok.encode(text) == hf.encode(text), (load, text)
            assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), (load, text)


def _request(prompt: list[int], skip: bool) -> EngineCoreRequest:
    return EngineCoreRequest("r", prompt, SamplingParams(skip_special_tokens=skip))


@pytest.mark.parametrize("name", NAMES)
def test_decoding_matches_autotokenizer(checkpoints: dict[str, str], references: dict[str, Any],
                                        name: str) -> None:
    hf = references[name]
    tok, _ = _front_end(checkpoints[name])
    rng = random.Random(name)
    sequences = [hf.encode(text) for text in TEXTS]
    sequences += [[rng.randrange(len(hf)) for _ in range(rng.randrange(1, 40))] for _ in range(20)]
    sequences.append(list(range(len(hf))))
    prompt = hf.encode("def main():\n    print('héllo 日本')\n")
    for ids in sequences:
        for skip in (False, True):
            expected = hf.decode(ids, skip_special_tokens=skip)
            assert tok.decode(ids, skip_special_tokens=skip) == expected, (ids, skip)
            detok = IncrementalDetokenizer.from_request(tok, _request([], skip))
            streamed = "".join(detok.update([t]) for t in ids) + detok.flush()
            # Where the ids hold invalid UTF-8, ByteFallback turns a whole run of byte tokens
            # into U+FFFD, valid bytes of it included: a stream has sent those on already
            # (as vLLM's DecodeStream-based detokenizer does). Elsewhere the two are one text.
            if "\ufffd" not in expected:
                assert streamed == expected, (ids, skip)
            # After a prompt: the text the ids add to the prompt's.
            detok = IncrementalDetokenizer.from_request(tok, _request(prompt, skip))
            streamed = "".join(detok.update([t]) for t in ids) + detok.flush()
            head = hf.decode(prompt, skip_special_tokens=skip)
            whole = hf.decode(prompt + ids, skip_special_tokens=skip)
            if whole.startswith(head) and "\ufffd" not in whole:
                assert streamed == whole[len(head):], (ids, skip)
    assert tok.decode(5) == hf.decode(5)


@pytest.mark.parametrize("name", NAMES)
def test_special_tokens_match_autotokenizer(checkpoints: dict[str, str], references: dict[str, Any],
                                            name: str) -> None:
    hf = references[name]
    tok, _ = _front_end(checkpoints[name])
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id",
                 "pad_token_id", "unk_token_id", "vocab_size", "chat_template", "model_max_length"):
        assert getattr(tok, attr) == getattr(hf, attr), attr
    assert len(tok) == len(hf) and tok.get_vocab() == hf.get_vocab()
    assert tok.all_special_tokens == hf.all_special_tokens and tok.all_special_ids == hf.all_special_ids
    ids = hf.encode(TEXTS[10])
    assert tok.convert_ids_to_tokens(ids, skip_special_tokens=True) == hf.convert_ids_to_tokens(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", NAMES)
def test_cached_verdict_loads_without_transformers(checkpoints: dict[str, str], references: dict[str, Any],
                                                   name: str) -> None:
    """Once a verdict is cached, the lean tokenizer loads without asking transformers, also
    where transformers rebuilds the file's pipeline (the verdict records what it builds)."""
    path = checkpoints[name]
    load_tokenizer(EngineConfig(model=path))  # the verdict, if no test before made it
    tok = load_lean_tokenizer(path, load_full=lambda: pytest.fail("transformers' tokenizer was loaded"))
    assert isinstance(tok, LeanTokenizer)
    for text in TEXTS:
        assert tok.encode(text) == references[name].encode(text), text


def test_second_start_imports_neither_transformers_nor_torch(checkpoints: dict[str, str], verdict_cache: str) -> None:
    code = ("import sys\n"
            "from tidal.frontend.engine_setup import load_tokenizer\n"
            "from tidal.protocol.config import EngineConfig\n"
            f"tok = load_tokenizer(EngineConfig(model={checkpoints['qwen2']!r}))\n"
            "print(type(tok).__name__, 'torch' in sys.modules, 'transformers' in sys.modules)\n")
    env = dict(os.environ, TIDAL_CACHE_DIR=os.path.join(verdict_cache, "subprocess"))
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                           env=env).stdout.split() for _ in range(2)]
    assert outs[0][0] == "LeanTokenizer"  # the first start compares with transformers' tokenizer
    assert outs[1] == ["LeanTokenizer", "False", "False"]


def _verdict_files(cache: str) -> list[str]:
    return sorted(glob.glob(os.path.join(cache, "tokenizer-verdicts", "*.json")))


def test_corrupt_or_unreadable_verdicts_are_recomputed(checkpoints: dict[str, str], references: dict[str, Any],
                                                       tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = str(tmp_path / "cache")
    monkeypatch.setenv("TIDAL_CACHE_DIR", cache)
    path, hf = checkpoints["qwen2"], references["qwen2"]
    load_tokenizer(EngineConfig(model=path))
    (verdict,) = _verdict_files(cache)
    for garbage in (b"", b"{not json", b"[]", json.dumps({"format": 1, "lean": "yes"}).encode(),
                    json.dumps({"format": 1, "lean": True, "patch": {"model": {}}}).encode(), b"\xff\xfe"):
        with open(verdict, "wb") as f:
            f.write(garbage)
        tok, ip = _front_end(path)
        for text in TEXTS[1:]:
            assert ip.process("r", text, SamplingParams())[0].prompt_token_ids == hf.encode(text)
        with open(verdict, encoding="utf-8") as f:
            assert isinstance(json.load(f), dict)  # rewritten whole
    os.chmod(verdict, 0)  # unreadable (when not root): recomputed, and still right
    try:
        tok, _ = _front_end(path)
        assert tok.encode(TEXTS[6]) == hf.encode(TEXTS[6])
    finally:
        os.chmod(verdict, 0o644)
    assert not [p for p in os.listdir(os.path.dirname(verdict)) if not p.endswith(".json")]  # no temp files left


def test_verdict_follows_config_model_type(checkpoints: dict[str, str], tmp_path: Any) -> None:
    """The same tokenizer files under another config.json model_type: AutoTokenizer picks
    another class, and tidal follows (the verdict is keyed by config.json as well)."""
    from transformers import AutoTokenizer

    path = str(tmp_path / "qwen3-as-qwen2")
    shutil.copytree(checkpoints["qwen3"], path)
    before = _front_end(path)[0].encode(TEXTS[6])
    _edit(path, "config.json", lambda c: c.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"]))
    after = _front_end(path)[0].encode(TEXTS[6])
    assert after == AutoTokenizer.from_pretrained(path).encode(TEXTS[6]) != before
