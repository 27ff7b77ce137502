"""A light tokenizer read from a saved Hugging Face tokenizer folder, without importing transformers.

Importing ``transformers`` costs seconds and ~100 MB, which a short ``fastforward generate`` cannot afford. A
tokenizer folder saved by transformers (``tokenizer.json``, ``tokenizer_config.json``, maybe
``special_tokens_map.json`` and ``chat_template.jinja``) holds everything encoding and decoding need: the Rust
``tokenizers`` pipeline does the work and this module reproduces the few decisions transformers' fast tokenizer
makes around it (special tokens, the post-processor, space clean-up on decode, chat-template rendering), so its
outputs equal ``transformers.AutoTokenizer.from_pretrained(folder)``'s.

:class:`LightTokenizer` implements only what fastforward calls: ``tok(text, add_special_tokens=...)``, ``encode``,
``decode``, ``batch_decode``, ``apply_chat_template`` of one conversation into text, ``chat_template``, the special
tokens and their ids, ``get_vocab``, ``len``, ``add_tokens`` and ``save_pretrained``. Everything else asks
transformers: :meth:`LightTokenizer.transformers` is the full transformers tokenizer for the same folder (loaded on
first need), and any other public attribute, or a call with options the light path does not take (tensors,
padding, batches, pairs, a chat template tokenized...), is answered by it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

# The named special tokens transformers knows, in the order it lists them (``all_special_tokens``).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
          "chat_template.json", "added_tokens.json")
_TEMPLATE_DIR = "additional_chat_templates"


class Encoding(dict):
    """The result of calling the tokenizer: a dict (``input_ids``, ``attention_mask``) also readable as attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _added_token(value) -> AddedToken | str | None:
    """A special token as written in a tokenizer config: a string, or a serialised ``AddedToken`` dict."""
    if value is None or isinstance(value, (str, AddedToken)):
        return value
    if isinstance(value, dict) and "content" in value:
        fields = {k: v for k, v in value.items() if k != "__type"}
        return AddedToken(**fields)
    return None


def _to_ids(token_ids) -> Any:
    """Plain Python ints (or lists of them) from lists, tuples, tensors, numpy arrays and numpy/torch scalars."""
    if hasattr(token_ids, "tolist") and not isinstance(token_ids, (list, tuple)):
        token_ids = token_ids.tolist()  # tensor, ndarray or numpy scalar
    if isinstance(token_ids, (list, tuple)):
        return [_to_ids(t) for t in token_ids]
    return int(token_ids)


class LightTokenizer:
    """A fast tokenizer over ``tokenizers.Tokenizer`` that behaves like transformers' for what fastforward uses
    (see the module docstring); anything else is :meth:`transformers`'."""

    def __init__(self, backend: Tokenizer, config: dict | None = None, chat_template=None,
                 folder: str | Path | None = None, special_tokens_map: dict | None = None):
        config = dict(config or {})
        self._backend = backend
        self._hf = None
        self.folder = Path(folder) if folder is not None else None
        self.chat_template = chat_template
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False))
        self._clean_up_bpe_anyway = bool(
            config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
        self._attention_mask = "attention_mask" in config.get("model_input_names", ["attention_mask"])
        self._modified = False
        self._grown = False  # tokens added since loading (save_pretrained writes the backend then)

        # The backend's own padding/truncation settings are never applied by a plain transformers call (it resets
        # them before every encode); only the pad token they name is kept as a default.
        padding = backend.padding
        backend.no_truncation()
        backend.no_padding()

        # Special tokens: the named ones, model-specific "*_token" entries, and the extra (additional) ones.
        named: dict[str, Any] = {}
        for key, value in (special_tokens_map or {}).items():
            # A legacy special_tokens_map.json overrides the config (its tokens are special by definition).
            if isinstance(value, dict) and key != "extra_special_tokens":
                value = {k: v for k, v in value.items() if k not in ("special", "__type")}
                value = AddedToken(**value, special=True)
            elif key == "extra_special_tokens" and isinstance(value, list):
                merged = list(config.get("extra_special_tokens") or [])
                for tok in value:
                    if isinstance(tok, dict):
                        tok = AddedToken(**{k: v for k, v in tok.items() if k not in ("special", "__type")},
                                         special=True)
                    if tok not in merged:
                        merged.append(tok)
                value = merged
            config[key] = value
        if padding is not None and config.get("pad_token") is None:
            config["pad_token"] = padding.get("pad_token")
        extra = config.get("extra_special_tokens")
        if extra is None:
            extra = config.get("additional_special_tokens")
        model_specific: dict[str, Any] = {}
        for key, value in config.items():
            if key in SPECIAL_TOKEN_NAMES:
                named[key] = _added_token(value)
            elif key.endswith("_token") and isinstance(_added_token(value), (str, AddedToken)):
                model_specific[key] = _added_token(value)
        if isinstance(extra, dict):
            model_specific.update({k: _added_token(v) for k, v in extra.items()})
            extra = []
        # Named tokens listed in the config's added tokens keep those tokens' flags (lstrip, normalized...).
        by_content = {str(t): t for t in map(_added_token, (config.get("added_tokens_decoder") or {}).values())
                      if isinstance(t, AddedToken)}
        named = {k: by_content.get(str(v), v) if v is not None else None for k, v in named.items()}
        named.update(model_specific)
        self._names = list(SPECIAL_TOKEN_NAMES) + [k for k in model_specific if k not in SPECIAL_TOKEN_NAMES]
        self._special = {k: v for k, v in named.items() if v is not None}
        self._extra = [t for t in (_added_token(v) for v in (extra or [])) if t is not None]

        self._register_special_tokens(config.get("added_tokens_decoder") or {})
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        if backend.post_processor is None:
            # transformers installs a template processor then; without add_bos/add_eos (ignored when a
            # tokenizer.json exists) it adds nothing.
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1",
                                                                   special_tokens=[])

    def _register_special_tokens(self, added_tokens_decoder: dict) -> None:
        """Make every special token an added special token of the backend, as transformers does on load."""
        backend = self._backend
        present = {t.content for t in backend.get_added_tokens_decoder().values()}
        missing = [_added_token(v) for _, v in sorted(added_tokens_decoder.items(), key=lambda kv: int(kv[0]))]
        missing = [t for t in missing if isinstance(t, AddedToken)]
        wanted = list(self._special.values()) + list(self._extra)
        for token in wanted:
            if str(token) not in present and all(str(token) != str(m) for m in missing):
                missing.append(AddedToken(token, special=True) if isinstance(token, str) else token)
        if missing:
            backend.add_tokens(missing)
        as_special = [t if isinstance(t, AddedToken) else AddedToken(t, special=True, normalized=False)
                      for t in wanted]
        if as_special:
            backend.add_special_tokens(as_special)

    # ------------------------------------------------------------------------------------------------------------
    # Loading and saving
    # ------------------------------------------------------------------------------------------------------------

    @classmethod
    def from_folder(cls, folder: str | Path) -> LightTokenizer:
        """Read a tokenizer folder saved by transformers (it must contain ``tokenizer.json``)."""
        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file} does not exist")
        backend = Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(folder / "tokenizer_config.json") or {}
        config.pop("tokenizer_class", None)
        # A tokenizer.json's post-processor decides BOS/EOS; transformers drops these flags then.
        config.pop("add_bos_token", None)
        config.pop("add_eos_token", None)
        special_map = None
        if "added_tokens_decoder" not in config:
            special_map = _read_json(folder / "special_tokens_map.json")
        return cls(backend, config, _read_chat_template(folder, config), folder=folder,
                   special_tokens_map=special_map)

    def save_pretrained(self, save_directory: str | Path, **kwargs) -> tuple[str, ...]:
        """Copy the tokenizer files into ``save_directory`` (named special tokens changed since loading are
        written into its ``tokenizer_config.json``)."""
        if kwargs.get("filename_prefix") or kwargs.get("push_to_hub"):
            return self.transformers().save_pretrained(save_directory, **kwargs)
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        saved = []
        if self.folder is None or self._grown:
            self._backend.save(str(out / "tokenizer.json"))
            saved.append(str(out / "tokenizer.json"))
        if self.folder is not None:
            for name in _FILES:
                if self._grown and name == "tokenizer.json":
                    continue
                if (self.folder / name).is_file():
                    if (self.folder / name).resolve() != (out / name).resolve():
                        shutil.copyfile(self.folder / name, out / name)
                    saved.append(str(out / name))
            if (self.folder / _TEMPLATE_DIR).is_dir():
                shutil.copytree(self.folder / _TEMPLATE_DIR, out / _TEMPLATE_DIR, dirs_exist_ok=True)
        if self._modified or self.folder is None or not (out / "tokenizer_config.json").is_file():
            config = _read_json(out / "tokenizer_config.json") or {}
            for name in self._names:
                token = self._special.get(name)
                if token is None:
                    config.pop(name, None)
                else:
                    config[name] = str(token)
            if isinstance(self.chat_template, str) and not (out / "chat_template.jinja").is_file():
                config["chat_template"] = self.chat_template
            (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                       encoding="utf-8")
            if str(out / "tokenizer_config.json") not in saved:
                saved.append(str(out / "tokenizer_config.json"))
        return tuple(saved)

    # ------------------------------------------------------------------------------------------------------------
    # Special tokens
    # ------------------------------------------------------------------------------------------------------------

    def _token(self, name: str) -> str | None:
        token = self._special.get(name)
        return None if token is None else str(token)

    def _set_token(self, name: str, value) -> None:
        if value is not None and not isinstance(value, (str, AddedToken)):
            raise ValueError(f"Cannot set a non-string value as the {name}")
        if value is None:
            self._special.pop(name, None)
        else:
            self._special[name] = value
        self._modified = True
        self._hf = None  # a transformers tokenizer loaded earlier no longer matches

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {name: str(self._special[name]) for name in self._names if self._special.get(name) is not None}

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            index = self._backend.token_to_id(tokens)
            return self.unk_token_id if index is None and tokens != self._token("unk_token") else index
        return [self.convert_tokens_to_ids(t) for t in tokens]

    # ------------------------------------------------------------------------------------------------------------
    # Vocabulary
    # ------------------------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def add_tokens(self, new_tokens, special_tokens: bool = False) -> int:
        """Append tokens to the vocabulary (existing ids never change), as transformers' ``add_tokens``; returns
        how many were new. Special ones are skipped by ``decode(skip_special_tokens=True)`` and saved with the
        tokenizer (``save_pretrained`` then writes the grown ``tokenizer.json``)."""
        if isinstance(new_tokens, (str, AddedToken)):
            new_tokens = [new_tokens]
        have = self.get_vocab()
        tokens = [t if isinstance(t, AddedToken) else AddedToken(t, special=special_tokens, normalized=not
                                                                  special_tokens) for t in new_tokens]
        tokens = [t for t in tokens if t.content not in have]
        if not tokens:
            return 0
        if special_tokens:
            self._backend.add_special_tokens(tokens)
            self._extra.extend(t for t in tokens if all(str(t) != str(e) for e in self._extra))
        else:
            self._backend.add_tokens(tokens)
        self._grown = True
        self._modified = True
        self._hf = None  # a transformers tokenizer loaded earlier no longer matches
        return len(tokens)

    # ------------------------------------------------------------------------------------------------------------
    # Encoding and decoding
    # ------------------------------------------------------------------------------------------------------------

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text=None, text_pair=None, add_special_tokens: bool = True, **kwargs):
        """Token ids for a string: ``{"input_ids": [...], "attention_mask": [...]}``."""
        if text_pair is not None or kwargs or not isinstance(text, str):
            return self.transformers()(text, text_pair, add_special_tokens=add_special_tokens, **kwargs)
        ids = self._encode(text, add_special_tokens)
        out = Encoding(input_ids=ids)
        if self._attention_mask:
            out["attention_mask"] = [1] * len(ids)
        return out

    def encode(self, text, text_pair=None, add_special_tokens: bool = True, **kwargs):
        """Token ids (a list of ints) for ``text``."""
        if text_pair is not None or kwargs or not isinstance(text, str):
            return self.transformers().encode(text, text_pair, add_special_tokens=add_special_tokens, **kwargs)
        return self._encode(text, add_special_tokens)

    def _decode_one(self, ids: list[int], skip_special_tokens: bool) -> str:
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        # transformers skips the WordPiece-era clean-up for BPE models unless forced.
        if self._clean_up and (type(self._backend.model).__name__ != "BPE" or self._clean_up_bpe_anyway):
            text = _clean_up_tokenization(text)
        return text

    def decode(self, token_ids, skip_special_tokens: bool = False, **kwargs):
        """Text for a sequence of ids (list, tuple, tensor, array or a single id); a list of texts for a batch."""
        if kwargs:
            return self.transformers().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        ids = _to_ids(token_ids)
        if isinstance(ids, int):
            ids = [ids]
        if ids and isinstance(ids[0], list):
            return [self._decode_one(seq, skip_special_tokens) for seq in ids]
        return self._decode_one(ids, skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False, **kwargs) -> list[str]:
        out = self.decode(sequences, skip_special_tokens=skip_special_tokens, **kwargs)
        return [out] if isinstance(out, str) else out

    # ------------------------------------------------------------------------------------------------------------
    # Chat templates
    # ------------------------------------------------------------------------------------------------------------

    def _template(self) -> str | None:
        """The template to render (a folder's default one when it has several), or None (transformers' error)."""
        if isinstance(self.chat_template, dict):
            return self.chat_template.get("default")
        return self.chat_template

    def apply_chat_template(self, conversation, add_generation_prompt: bool = False, tokenize: bool = False,
                            return_dict: bool = False, **kwargs):
        """``conversation`` (a list of ``{"role", "content"}`` dicts) rendered with the chat template as transformers
        does: its text, or with ``tokenize`` its token ids (a dict when ``return_dict``). Anything else (a batch,
        tools, documents, another template, template variables) is :meth:`transformers`'."""
        template = self._template()
        light = not kwargs and template is not None and isinstance(conversation, (list, tuple)) \
            and len(conversation) > 0 and all(isinstance(m, dict) for m in conversation)
        if not light:
            return self.transformers().apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=tokenize, return_dict=return_dict,
                **kwargs)
        messages = []
        for message in _plain(list(conversation)):
            message = {k: v for k, v in message.items() if v is not None}
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            messages.append(message)
        text = _compile_template(template).render(messages=messages, tools=None, documents=None,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **_plain(self.special_tokens_map))
        if not tokenize:
            return text
        ids = self._encode(text, False)
        return Encoding(input_ids=ids, attention_mask=[1] * len(ids)) if return_dict else ids

    # ------------------------------------------------------------------------------------------------------------
    # Everything else: the full transformers tokenizer
    # ------------------------------------------------------------------------------------------------------------

    def transformers(self):
        """The transformers tokenizer for the same folder (with the special tokens set here), loaded on first use:
        what to ask for anything this class does not implement."""
        if self._hf is None:
            if self.folder is None:
                raise AttributeError("this LightTokenizer has no folder to load a transformers tokenizer from")
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(self.folder), local_files_only=True)
            if self._modified:
                for name in self._names:
                    setattr(hf, name, self._special.get(name))
            self._hf = hf
        return self._hf

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.transformers(), name)

    def __repr__(self) -> str:
        return f"LightTokenizer(folder={str(self.folder or '')!r}, special_tokens={self.special_tokens_map})"


def _special_token_property(name: str, as_id: bool):
    def get(self):
        token = self._token(name)
        if token is None:
            return None
        return self.convert_tokens_to_ids(token) if as_id else token

    def set(self, value):
        if as_id and value is not None:
            value = self._backend.id_to_token(int(value))
        self._set_token(name, value)

    return property(get, set, doc=f"The {name.replace('_', ' ')}{' id' if as_id else ''} (None when unset).")


for _name in SPECIAL_TOKEN_NAMES:
    setattr(LightTokenizer, _name, _special_token_property(_name, as_id=False))
    setattr(LightTokenizer, _name + "_id", _special_token_property(_name, as_id=True))
del _name


# ----------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------


def _read_json(path: Path):
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _read_chat_template(folder: Path, config: dict):
    """The chat template(s) the way transformers finds them: ``chat_template.jinja`` and
    ``additional_chat_templates/*.jinja`` take priority over the config's ``chat_template`` entry."""
    templates = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if (folder / _TEMPLATE_DIR).is_dir():
        for path in sorted((folder / _TEMPLATE_DIR).glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if len(templates) == 1 and "default" in templates:
        return templates["default"]
    if templates:
        return templates
    template = config.get("chat_template")
    if template is None and (folder / "chat_template.json").is_file():
        template = (_read_json(folder / "chat_template.json") or {}).get("chat_template")
    if isinstance(template, (list, tuple)):
        return {t["name"]: t["template"] for t in template}
    return template


def _clean_up_tokenization(text: str) -> str:
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _plain(value):
    """Only plain JSON-like data reaches a (untrusted) chat template: strings, numbers, lists, dicts."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return _plain(value.item())
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


@lru_cache(maxsize=16)
def _compile_template(source: str):
    """Compile a chat template in a sandbox set up like transformers' (same globals, filters and extensions)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text for masks): rendered as its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        """``dict(...)`` for templates without exposing the dict type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """A namespace that refuses underscore-prefixed attributes."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}.")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)
