"""Tokenizers: the byte tokenizer, and SmolLM2's BPE tokenizer rebuilt from its GGUF file."""
import jinja2
import pytest
from tokenizers import pre_tokenizers

from toyllm.tokenizer import ByteTokenizer, GGUFTokenizer
from toyllm.weights import load_tokenizer

# The library alone: no exercise runs here (tests/conftest.py checks it), so the student edition leaves it out.
pytestmark = pytest.mark.library

USER_PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


# --------------------------------------------------------------------------- ByteTokenizer

def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo, 12345 wörld 🤖\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.encode("é") == [195, 169]
    assert tok.decode(ids) == text
    assert tok.vocab_size == 256 and tok.bos_id is None and tok.eos_id is None


def test_byte_tokenizer_edge_cases():
    tok = ByteTokenizer()
    assert tok.encode("") == [] and tok.decode([]) == ""
    assert tok.decode([195]) == "\ufffd"          # half of "é": replaced, not an exception
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        tok.decode([65, 300])
    with pytest.raises(ValueError, match="str"):
        tok.encode(b"bytes")


def test_byte_tokenizer_chat():
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs) == "system: Be brief.\nuser: Hi\nassistant: "
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "system: Be brief.\nuser: Hi\n"
    assert tok.encode_chat("Hi") == list(b"user: Hi\nassistant: ")
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])
    with pytest.raises(ValueError, match="list"):
        tok.apply_chat_template({"role": "user", "content": "not in a list"})


# --------------------------------------------------------------------------- a tiny hand-built BPE tokenizer

def _mini_tokenizer(template="{{ messages[0]['content'] }}"):
    """Byte alphabet + one merge + one control token: no model file needed."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<|im_start|>"] + alphabet + ["ab"]
    types = [3] + [1] * (len(tokens) - 1)
    return GGUFTokenizer(tokens, ["a b"], types, bos_id=0, eos_id=0, add_bos=False, chat_template=template)


def test_mini_bpe_merges_digits_and_control_tokens():
    tok = _mini_tokenizer()
    ab = tok.vocab_size - 1
    ids = tok.encode("ab<|im_start|>12")
    assert ids[0] == ab and ids[1] == 0 and len(ids) == 4     # "ab" merged, control token whole, 2 digits
    assert tok.decode(ids) == "ab<|im_start|>12"
    assert tok.decode(ids, skip_special_tokens=True) == "ab12"


def test_add_bos_follows_metadata():
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = GGUFTokenizer(["<s>"] + alphabet, [], [3] + [1] * 256, bos_id=0, eos_id=0, add_bos=True)
    assert tok.encode("a")[0] == 0 and len(tok.encode("a")) == 2
    assert tok.encode("") == [0]


def test_chat_template_runs_sandboxed():
    tok = _mini_tokenizer("{{ ''.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok = _mini_tokenizer("{{ raise_exception('only user turns') }}")
    with pytest.raises(jinja2.exceptions.TemplateError, match="only user turns"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_unknown_pre_tokenizer_rejected():
    with pytest.raises(ValueError, match="pre-tokenizer"):
        GGUFTokenizer(["a"], [], pre="qwen2")


# --------------------------------------------------------------------------- SmolLM2's tokenizer

@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return load_tokenizer("smollm2-135m")


def test_smollm2_special_ids(smol):
    assert smol.vocab_size == 49152
    assert (smol.bos_id, smol.eos_id) == (1, 2)           # tokenizer.ggml.bos_token_id / eos_token_id
    assert smol.id_to_token(1) == "<|im_start|>" and smol.id_to_token(2) == "<|im_end|>"
    assert smol.add_bos is False                           # SmolLM2 does not prepend BOS
    assert len(smol.control_ids) == 17 and smol.control_ids[:3] == [0, 1, 2]


def test_smollm2_control_tokens_stay_whole(smol):
    assert smol.encode("<|im_start|>") == [1]
    assert smol.encode("<|im_start|>user\nHi<|im_end|>") == [1, 4093, 198, 26843, 2]


def test_smollm2_digits_split_one_by_one(smol):
    ids = smol.encode("12345")
    assert ids == [33, 34, 35, 36, 37]
    assert [smol.decode([i]) for i in ids] == list("12345")
    # The digits are split off before the GPT-2 regex, which leaves the space on its own.
    assert [smol.id_to_token(i) for i in smol.encode("in 2024")] == ["in", "Ġ", "2", "0", "2", "4"]


def test_smollm2_round_trip(smol):
    for text in ["Hello, world!", "  two  spaces\n\ttab", "héllo 🤖👍 日本語, 3.14159", "x" * 300, "<|im_end|>"]:
        assert smol.decode(smol.encode(text)) == text
    assert smol.encode("Hello, world!") == [19556, 28, 905, 17]
    assert smol.encode("") == [] and smol.decode([]) == ""
    assert smol.encode("hi")[0] != smol.bos_id
    with pytest.raises(ValueError, match="49152"):
        smol.decode([49152])


def test_smollm2_chat_template(smol):
    text = smol.apply_chat_template(USER_PROMPT)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")   # default system
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    own = smol.apply_chat_template([{"role": "system", "content": "Be brief."}] + USER_PROMPT,
                                   add_generation_prompt=False)
    assert own == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                   "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n")
    ids = smol.encode_chat("What is the capital of France?")
    assert ids == smol.encode(text)
    assert ids[:3] == [1, 9690, 198] and ids[-4:] == [1, 520, 9531, 198] and ids.count(1) == 3
