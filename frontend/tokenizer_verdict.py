"""Whether the front-end's LeanTokenizer may stand in for transformers' tokenizer of a directory,
and exactly what transformers changes in the file's pipeline: a verdict made once per tokenizer
files and library versions, cached on disk so that later starts need not import transformers.

transformers does not always run `tokenizer.json` as written: `AutoTokenizer` picks a class from
tokenizer_config.json *and* config.json's model_type, and that class may rebuild parts of the
Rust pipeline (Qwen2Tokenizer swaps in its own digit-splitting pre-tokenizer and NFC, LlamaTokenizer
its Metaspace and Strip decoder, TokenizersBackend adds a post-processor where the file has
none), add special tokens the file lacks, or set `encode_special_tokens`. Guessing which class does
what drifts with every transformers release, so the verdict does not guess: it loads the real
tokenizer, serializes the Rust pipeline transformers actually runs, and records its differences
from the file (the "patch") together with the attributes the front-end answers itself. The lean
tokenizer is the file's pipeline with that patch applied; it is accepted only when its
serialization equals transformers' exactly, the class overrides none of the Python methods it
replaces, and a probe corpus encodes and decodes the same both ways.

Cache: $TIDAL_CACHE_DIR/tokenizer-verdicts/<key>.json, the key a hash of every file transformers
reads for the tokenizer (config.json included), the versions of transformers and tokenizers, and
this format. A file that is unreadable, corrupt or fails its digest is ignored and rewritten.
Only positive verdicts are stored: where the lean path is refused, transformers loads anyway.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from importlib import metadata
from typing import Any

from tidal.protocol import envs

logger = logging.getLogger(__name__)

FORMAT = 1
NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# Top-level tokenizer.json components a tokenizer class may rebuild; "model" is patched key by
# key (its vocab and merges never: a class that retrains them is not reproduced).
COMPONENTS = ("normalizer", "pre_tokenizer", "post_processor", "decoder", "added_tokens")
_MODEL_FIXED = ("vocab", "merges")
# Files AutoTokenizer may read for a local directory.
KEY_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
             "config.json", "chat_template.jinja", "chat_template.json")
# TokenizersBackend methods whose behaviour LeanTokenizer reproduces: a subclass overriding any
# of them runs Python the lean path does not.
_ANSWERED = frozenset({
    "encode", "decode", "_decode", "_encode_plus", "batch_decode", "tokenize", "_tokenize", "convert_ids_to_tokens",
    "convert_tokens_to_ids", "_convert_token_to_id_with_added_voc", "_convert_id_to_token", "get_vocab",
    "__len__", "vocab_size", "all_special_tokens", "all_special_ids", "convert_tokens_to_string",
    "clean_up_tokenization", "prepare_for_tokenization", *NAMED_SPECIAL, *(f"{n}_id" for n in NAMED_SPECIAL)})
_PROBES = ("Hello, my name is", "        self.pos = 0\n", "digits 0 42 1234567890 3.14", " x  y   \t\n\n z ",
           "héllo wörld 日本語 😀 e\u0301", "<|im_start|>user\nhi<|im_end|><s></s><unk>", "don't I'm . , !")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def verdict_key(path: str) -> str:
    """Hash of what decides transformers' tokenizer for the directory `path`."""
    parts = [f"format={FORMAT}", f"transformers={_version('transformers')}", f"tokenizers={_version('tokenizers')}"]
    for name in KEY_FILES:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file, "rb") as f:
                parts.append(f"{name}={_sha256(f.read())}")
    return _sha256("\n".join(parts).encode())


def _verdict_path(key: str) -> str:
    return os.path.join(envs.TIDAL_CACHE_DIR, "tokenizer-verdicts", f"{key[:40]}.json")


def _digest(verdict: dict[str, Any]) -> str:
    return _sha256(json.dumps(verdict, sort_keys=True, ensure_ascii=True).encode())


def _is_valid(verdict: Any) -> bool:
    """The verdict's fields have the types build_backend and LeanTokenizer rely on."""
    if not isinstance(verdict, dict):
        return False
    patch, specials = verdict.get("patch"), verdict.get("specials")
    if not isinstance(patch, dict) or not set(patch) <= {*COMPONENTS, "model"}:
        return False
    if not isinstance(patch.get("model", {}), dict) or set(patch.get("model", {})) & set(_MODEL_FIXED):
        return False
    if not isinstance(specials, dict) or set(specials) != set(NAMED_SPECIAL):
        return False
    if not all(v is None or isinstance(v, str) for v in specials.values()):
        return False
    tokens = verdict.get("all_special_tokens")
    return (isinstance(tokens, list) and all(isinstance(t, str) for t in tokens)
            and isinstance(verdict.get("encode_special_tokens"), bool)
            and isinstance(verdict.get("clean_up_tokenization_spaces"), bool)
            and type(verdict.get("model_max_length")) in (int, float)
            and (verdict.get("chat_template") is None or isinstance(verdict.get("chat_template"), str)))


def read_verdict(key: str) -> dict[str, Any] | None:
    """The cached verdict for `key`, or None when there is none or it cannot be trusted."""
    try:
        with open(_verdict_path(key), "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError):  # missing, unreadable, not UTF-8, not JSON
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != key:
        return None
    verdict = data.get("verdict")
    if not _is_valid(verdict) or data.get("digest") != _digest(verdict):
        return None
    return verdict


def write_verdict(key: str, verdict: dict[str, Any]) -> None:
    """Store `verdict` atomically (a temporary file renamed over the old one); a cache that
    cannot be written only costs the next start a comparison."""
    path = _verdict_path(key)
    data = json.dumps({"format": FORMAT, "key": key, "verdict": verdict, "digest": _digest(verdict)},
                      ensure_ascii=False)
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=os.path.dirname(path), suffix=".tmp",
                                         delete=False) as f:
            tmp = f.name
            f.write(data)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        logger.debug("tokenizer verdict not cached at %s: %s", path, e)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def build_backend(spec: dict[str, Any], verdict: dict[str, Any]) -> Any:
    """The Rust tokenizer transformers runs: the file's `spec` with the verdict's patch."""
    from tokenizers import Tokenizer

    spec = dict(spec)
    patch = verdict["patch"]
    for name in COMPONENTS:
        if name in patch:
            spec[name] = patch[name]
    if "model" in patch:
        spec["model"] = {**spec["model"], **patch["model"]}
    backend = Tokenizer.from_str(json.dumps(spec))
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = verdict["encode_special_tokens"]
    return backend


def _pipeline(backend: Any) -> dict[str, Any]:
    return json.loads(backend.to_str())


def _overrides_answered(full: Any) -> bool:
    """Whether `full`'s class is not TokenizersBackend, or changes a method LeanTokenizer answers."""
    for cls in type(full).__mro__:
        if cls.__name__ == "TokenizersBackend":
            return False
        if _ANSWERED & set(vars(cls)):
            return True
    return True  # not a TokenizersBackend at all (a slow or custom tokenizer)


def _patch(spec: dict[str, Any], built: dict[str, Any]) -> dict[str, Any] | None:
    """What differs between the file's pipeline and transformers'; None when not patchable."""
    if built.get("truncation") is not None or built.get("padding") is not None:
        return None  # transformers truncates or pads: its job
    if set(built) - {*COMPONENTS, "model", "version", "truncation", "padding"}:
        return None  # a component this module does not know
    patch: dict[str, Any] = {name: built.get(name) for name in COMPONENTS if spec.get(name) != built.get(name)}
    model, built_model = spec.get("model") or {}, built.get("model") or {}
    changed = {k for k in set(model) | set(built_model) if model.get(k) != built_model.get(k)}
    if changed & set(_MODEL_FIXED) or changed - set(built_model):
        return None
    if changed:
        patch["model"] = {k: built_model[k] for k in changed}
    return patch


def judge(spec: dict[str, Any], full: Any) -> dict[str, Any] | None:
    """The verdict for a directory whose tokenizer.json is `spec` and whose transformers
    tokenizer is `full`, or None where LeanTokenizer would not behave exactly as `full`."""
    backend = getattr(full, "_tokenizer", None)
    if _overrides_answered(full) or backend is None or not hasattr(backend, "to_str"):
        return None
    built = _pipeline(backend)
    patch = _patch(spec, built)
    if patch is None:
        return None
    clean_up = bool(getattr(full, "clean_up_tokenization_spaces", False))
    if clean_up and not (type(backend.model).__name__ == "BPE" and not getattr(
            full, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)):
        return None  # transformers rewrites decoded text (" ." -> "."); the detokenizer would not
    verdict = {"patch": patch, "encode_special_tokens": bool(backend.encode_special_tokens),
               "specials": {name: getattr(full, name, None) for name in NAMED_SPECIAL},
               "all_special_tokens": list(getattr(full, "all_special_tokens", [])),
               "clean_up_tokenization_spaces": clean_up, "model_max_length": getattr(full, "model_max_length", None),
               "chat_template": getattr(full, "chat_template", None)}
    try:
        verdict = json.loads(json.dumps(verdict))  # as it will read back
    except (TypeError, ValueError):
        return None
    if not _is_valid(verdict):
        return None
    lean = build_backend(spec, verdict)
    if _pipeline(lean) != built:
        return None
    return verdict if _probes_agree(lean, full) else None


def _probes_agree(lean: Any, full: Any) -> bool:
    """Belt and braces over the serialized comparison: a few texts, both ways."""
    for text in _PROBES:
        for special in (True, False):
            ids = full.encode(text, add_special_tokens=special)
            if lean.encode(text, add_special_tokens=special).ids != ids:
                return False
            for skip in (True, False):
                if lean.decode(ids, skip_special_tokens=skip) != full.decode(ids, skip_special_tokens=skip):
                    return False
    return True
