"""The light tokenizer (no transformers import) against transformers' own tokenizer for the same saved folder."""

import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastforward.tokenizer import LightTokenizer

TEXTS = [
    "",
    "Hi",
    "hello world",
    "Hello, World! How's it going? I'm fine, you're great, they've left.",
    " leading space",
    "trailing space ",
    "   three leading spaces and   runs   of    spaces     ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "\n",
    " ",
    "\t\t",
    "naïve café résumé Ünïcödé ß ø å",
    "日本語のテキストと中文文本 한국어",
    "emoji 😀🚀👍🏽 and family 👨‍👩‍👧‍👦 flags 🇫🇷",
    "Ελληνικά, русский, العربية, עברית, हिन्दी",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
    "<|im_start|>user\nhello<|im_end|>",
    "text <|im_start|> in the middle <|im_end|> and <|endoftext|> end",
    "<|im_start|><|im_end|><|endoftext|>",
    "not special: <|im_start |> < |im_end|> <im_start>",
    "<repo_name>x<file_sep>y<filename>z",
    "numbers 1234567890 3.14159 -42 1e10",
    "a" * 500,
    "zero\u200bwidth\u00a0nbsp\u2028line sep",
    "\x00\x01 control chars \x7f",
    "lone surrogate-free astral 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]

CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "Write a haiku about caches."},
        {"role": "assistant", "content": "Keys wait in memory\nvalues kept for the next step\nno need to recompute"},
        {"role": "user", "content": "Another, with emoji 🚀 and <|im_end|> inside."},
    ],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "multi\nline\n\n  indented"}, {"role": "assistant", "content": "ok"}],
]


@pytest.fixture(scope="module")
def folder():
    """The default model's cached tokenizer folder (created by the first-time conversion when missing)."""
    from fastforward.model import _gguf_tokenizer, packaged_gguf

    tok = _gguf_tokenizer(packaged_gguf("smollm2-135m"))
    assert isinstance(tok, LightTokenizer)
    assert (tok.folder / "tokenizer.json").is_file()
    return tok.folder


@pytest.fixture(scope="module")
def light(folder):
    return LightTokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoTokenizer

    from fastforward.model import _quiet_transformers

    _quiet_transformers()
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


# ----------------------------------------------------------------------------------------------------------------
# The default model against transformers
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_special_token_ids_match(light, hf):
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        assert getattr(light, name) == getattr(hf, name), name
        assert getattr(light, name + "_id") == getattr(hf, name + "_id"), name
    assert light.eos_token_id is not None and light.bos_token_id is not None and light.pad_token_id is not None
    assert light.all_special_ids == hf.all_special_ids
    assert light.all_special_tokens == hf.all_special_tokens
    assert light.special_tokens_map == hf.special_tokens_map
    assert light.vocab_size == hf.vocab_size
    assert len(light) == len(hf)
    assert light.chat_template == hf.chat_template
    assert light.get_vocab() == hf.get_vocab()


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_decode_match(light, hf, text, add_special_tokens):
    ids = light(text, add_special_tokens=add_special_tokens)["input_ids"]
    assert ids == hf(text, add_special_tokens=add_special_tokens)["input_ids"]
    assert light.encode(text, add_special_tokens=add_special_tokens) == ids
    assert dict(light(text, add_special_tokens=add_special_tokens)) == dict(
        hf(text, add_special_tokens=add_special_tokens))
    for skip in (False, True):
        assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert light.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert light.convert_tokens_to_ids(light.convert_ids_to_tokens(ids)) == ids


@pytest.mark.slow
def test_batch_call_and_decode_match(light, hf):
    texts = TEXTS[1:6]
    assert dict(light(texts)) == dict(hf(texts))
    batch = [light.encode(t) for t in texts]
    assert light.batch_decode(batch) == hf.batch_decode(batch)
    assert light.decode(batch, skip_special_tokens=True) == hf.decode(batch, skip_special_tokens=True)


@pytest.mark.slow
def test_decode_accepts_lists_tuples_tensors_and_single_ids(light, hf):
    ids = light.encode("<|im_start|>user\nHi there 😀<|im_end|>")
    text = hf.decode(ids)
    assert light.decode(tuple(ids)) == text
    assert light.decode(torch.tensor(ids)) == text
    assert light.decode(torch.tensor([ids])) == hf.decode(torch.tensor([ids]))
    assert light.decode(ids[3]) == hf.decode(ids[3])
    assert light.decode(torch.tensor(ids[3])) == hf.decode(torch.tensor(ids[3]))
    assert light.decode([]) == hf.decode([]) == ""
    assert light.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert light.convert_ids_to_tokens(ids, skip_special_tokens=True) == hf.convert_ids_to_tokens(
        ids, skip_special_tokens=True)
    assert light.convert_ids_to_tokens(ids[0]) == hf.convert_ids_to_tokens(ids[0])


@pytest.mark.slow
def test_tensor_outputs_match(light, hf):
    a, b = light("hello world", return_tensors="pt"), hf("hello world", return_tensors="pt")
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["attention_mask"], b["attention_mask"])
    assert a.input_ids.shape == (1, 2)


@pytest.mark.slow
@pytest.mark.parametrize("chat", CHATS, ids=range(len(CHATS)))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_matches(light, hf, chat, add_generation_prompt):
    text = light.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = light.apply_chat_template(chat, tokenize=True, add_generation_prompt=add_generation_prompt)
    assert ids == hf.apply_chat_template(chat, tokenize=True, return_dict=False,
                                         add_generation_prompt=add_generation_prompt)
    assert ids == light(text, add_special_tokens=False)["input_ids"]
    as_dict = light.apply_chat_template(chat, tokenize=True, return_dict=True,
                                        add_generation_prompt=add_generation_prompt)
    assert dict(as_dict) == dict(hf.apply_chat_template(chat, tokenize=True, return_dict=True,
                                                        add_generation_prompt=add_generation_prompt))


@pytest.mark.slow
def test_chat_template_batch_and_custom_template(light, hf):
    assert light.apply_chat_template(CHATS[:2], tokenize=False) == hf.apply_chat_template(CHATS[:2], tokenize=False)
    custom = ("{{ bos_token }}{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] | tojson }}"
              "{% if not loop.last %}\n{% endif %}{% endfor %}{{ eos_token }} {{ extra }}")
    kw = dict(chat_template=custom, tokenize=False, extra="x")
    assert light.apply_chat_template(CHATS[2], **kw) == hf.apply_chat_template(CHATS[2], **kw)
    with pytest.raises(Exception, match="nope"):
        light.apply_chat_template(CHATS[0], chat_template="{{ raise_exception('nope') }}")


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text())
def test_random_text_matches(light, hf, text):
    ids = light.encode(text)
    assert ids == hf.encode(text)
    assert light.decode(ids) == hf.decode(ids)
    assert light.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(min_value=0, max_value=49151), max_size=40))
def test_random_ids_decode_matches(light, hf, ids):
    for skip in (False, True):
        assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.slow
def test_save_pretrained_round_trips(light, hf, tmp_path):
    saved = light.save_pretrained(tmp_path / "tok")
    assert any(p.endswith("tokenizer.json") for p in saved)
    again = LightTokenizer.from_folder(tmp_path / "tok")
    text = TEXTS[19]
    assert again.encode(text) == hf.encode(text)
    assert again.chat_template == hf.chat_template
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    assert reloaded.encode(text) == hf.encode(text) and reloaded.eos_token_id == hf.eos_token_id


@pytest.mark.slow
def test_other_attributes_fall_back_to_transformers(folder, hf):
    tok = LightTokenizer.from_folder(folder)
    assert tok.num_special_tokens_to_add() == hf.num_special_tokens_to_add()
    assert tok.get_special_tokens_mask([1, 5, 2], already_has_special_tokens=True) == [1, 0, 1]
    padded = tok(["a", "a b c"], padding=True)  # padding is not on the light path
    assert padded["input_ids"] == hf(["a", "a b c"], padding=True)["input_ids"]
    with pytest.raises(AttributeError):
        getattr(tok, "_no_such_private_attribute")  # noqa: B009 (private names never load transformers)


@pytest.mark.slow
def test_first_conversion_returns_a_light_tokenizer(light, monkeypatch, tmp_path):
    from fastforward.model import _gguf_tokenizer, packaged_gguf

    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path))
    first = _gguf_tokenizer(packaged_gguf("smollm2-135m"))  # converts with transformers, saves the folder
    assert isinstance(first, LightTokenizer) and first.folder.name.endswith("-tokenizer")
    again = _gguf_tokenizer(packaged_gguf("smollm2-135m"))  # read back from the cache
    assert isinstance(again, LightTokenizer) and again.folder == first.folder
    for text in TEXTS:
        assert first.encode(text) == again.encode(text) == light.encode(text)
    assert first.apply_chat_template(CHATS[2], tokenize=False) == light.apply_chat_template(CHATS[2], tokenize=False)
    assert (first.eos_token_id, first.bos_token_id, first.pad_token_id) == (
        light.eos_token_id, light.bos_token_id, light.pad_token_id)


def _packed_path_available() -> bool:
    """Whether ``ff.load()`` of the default model takes the packed GGUF path (it needs the native kernels); without
    them it falls back to the model dequantised by transformers, tokenizer included."""
    from fastforward.kernels import load_native

    return load_native() is not None


@pytest.mark.slow
def test_target_uses_light_tokenizer(default_model):
    if not _packed_path_available():
        pytest.skip("native kernels unavailable: load() uses the transformers-dequantised model and its tokenizer")
    assert isinstance(default_model.tokenizer, LightTokenizer)
    ids = default_model.encode("Hi")
    assert "Hi" in default_model.decode(ids)


# Records who imports transformers first, so a failure names the culprit.
_NO_TRANSFORMERS = """
import sys, traceback

class Spy:
    stack = None

    def find_spec(self, name, path=None, target=None):
        if name == "transformers" and Spy.stack is None:
            Spy.stack = "".join(traceback.format_stack(limit=15)[:-1])
        return None

sys.meta_path.insert(0, Spy())
import fastforward as ff
m = ff.load(); ff.generate(m, 'Hi', max_new_tokens=4)
if Spy.stack:
    print("transformers first imported from:\\n" + Spy.stack, file=sys.stderr)
print('transformers' in sys.modules)
"""


@pytest.mark.slow
def test_load_and_generate_do_not_import_transformers():
    if not _packed_path_available():
        pytest.xfail("native kernels unavailable: load() falls back to _converted_gguf -> load_hf (transformers)")
    out = subprocess.run([sys.executable, "-c", _NO_TRANSFORMERS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr


# ----------------------------------------------------------------------------------------------------------------
# A tiny self-made tokenizer (fast; no model needed)
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from fastforward.testing import tiny_tokenizer_hf

    path = tmp_path_factory.mktemp("tiny-tok")
    tiny_tokenizer_hf().save_pretrained(path)
    return path


def test_tiny_tokenizer_matches_transformers(tiny_folder):
    from transformers import AutoTokenizer

    light, hf = LightTokenizer.from_folder(tiny_folder), AutoTokenizer.from_pretrained(str(tiny_folder))
    for text in TEXTS:
        ids = light.encode(text)
        assert ids == hf.encode(text)
        assert light.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert (light.eos_token_id, light.pad_token_id, light.bos_token_id) == (hf.eos_token_id, hf.pad_token_id,
                                                                             hf.bos_token_id)
    for chat in CHATS:
        assert light.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_missing_tokenizer_json_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        LightTokenizer.from_folder(tmp_path)


def test_setting_a_special_token(tiny_folder, tmp_path):
    tok = LightTokenizer.from_folder(tiny_folder)
    tok.pad_token = tok.eos_token
    assert tok.pad_token_id == tok.eos_token_id
    tok.save_pretrained(tmp_path / "out")
    assert LightTokenizer.from_folder(tmp_path / "out").pad_token_id == tok.eos_token_id


def _variant(tiny_folder, tmp_path, config_update=None, special_tokens_map=None, drop=(), no_post_processor=False):
    import json
    import shutil

    from tokenizers import Tokenizer

    out = tmp_path / "variant"
    shutil.copytree(tiny_folder, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    for key in drop:
        config.pop(key, None)
    config.update(config_update or {})
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    if special_tokens_map is not None:
        (out / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    if no_post_processor:
        backend = Tokenizer.from_file(str(out / "tokenizer.json"))
        backend.post_processor = None
        backend.save(str(out / "tokenizer.json"))
    return out


VARIANTS = {
    "legacy-special-tokens-map": dict(
        drop=("eos_token",),
        special_tokens_map={"eos_token": {"content": "<|im_end|>", "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False},
                            "bos_token": "<|im_start|>", "additional_special_tokens": ["<|endoftext|>"]}),
    "new-special-tokens": dict(config_update={"unk_token": "<unk>", "mask_token": "<mask>",
                                              "image_token": "<image>", "extra_special_tokens": ["<extra_0>"]}),
    "no-post-processor": dict(no_post_processor=True, config_update={"bos_token": "<|im_start|>",
                                                                      "add_bos_token": True}),
    "clean-up-spaces": dict(config_update={"clean_up_tokenization_spaces": True}),
    "clean-up-spaces-forced": dict(config_update={
        "clean_up_tokenization_spaces": True,
        "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiny_variants_match_transformers(tiny_folder, tmp_path, variant):
    from transformers import AutoTokenizer

    folder = _variant(tiny_folder, tmp_path, **VARIANTS[variant])
    light, hf = LightTokenizer.from_folder(folder), AutoTokenizer.from_pretrained(str(folder))
    assert light.special_tokens_map == hf.special_tokens_map
    assert light.all_special_tokens == hf.all_special_tokens
    assert light.all_special_ids == hf.all_special_ids
    assert len(light) == len(hf) and light.vocab_size == hf.vocab_size
    for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id", "mask_token_id"):
        assert getattr(light, name) == getattr(hf, name), name
    texts = TEXTS + ["<image> and <mask> <extra_0>, <unk> . hi , it 's"]
    for text in texts:
        for add in (True, False):
            ids = light.encode(text, add_special_tokens=add)
            assert ids == hf.encode(text, add_special_tokens=add), (text, add)
        for skip in (False, True):
            assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    chat = CHATS[2]
    assert light.apply_chat_template(chat, tokenize=False) == hf.apply_chat_template(chat, tokenize=False)
