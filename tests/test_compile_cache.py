"""Compiled decode steps kept on disk (toyllm.compile_cache): keys, buckets, damaged entries, the command line.

All but the last test compile nothing: the build and load functions are stand-ins that write and read a file.
Every test has its own cache folder (TOYLLM_CACHE, set by the ``cache`` fixture).
"""
import hashlib
import json

import pytest
import torch

import toyllm.compiled
from toyllm import compile_cache, load_model
from toyllm.cli import main
from toyllm.compile_cache import CACHE_ENV, cache_root, clear_cache, file_digest, list_entries, load_or_build
from toyllm.compiled import CompiledDecoder, capacity_bucket, compiled_decoder, step_key
from toyllm.generation import generate

PROMPT = list(range(5, 25))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


class FakeCompiler:
    """build writes a package of known bytes, load reads it back; both count their calls."""

    def __init__(self, payload=b"compiled step " * 100):
        self.payload, self.builds, self.loads = payload, 0, 0

    def build(self, path):
        self.builds += 1
        path.write_bytes(self.payload)

    def load(self, path):
        self.loads += 1
        data = path.read_bytes()
        if data != self.payload:
            raise RuntimeError("not a package")
        return data


def test_buckets_are_powers_of_two_and_one_and_a_half_times_them_from_64_up_to_the_context():
    assert [capacity_bucket(n, 8192) for n in (1, 64, 65, 69, 97, 129, 256, 257, 512, 513, 5000, 6145, 8192)] == \
        [64, 64, 96, 96, 128, 192, 256, 384, 512, 768, 6144, 8192, 8192]
    for n in range(65, 8193):                                  # never more than 1.5 times the rows asked for
        assert n <= capacity_bucket(n, 8192) <= 1.5 * n
    assert capacity_bucket(900, 1000) == 1000                 # a context that is no bucket caps the last
    assert capacity_bucket(100, 128) == 128
    with pytest.raises(ValueError, match="holds 1 to max_context=1024 tokens, asked for 1025"):
        capacity_bucket(1025, 1024)


def test_a_new_length_in_the_same_bucket_reuses_the_step():
    model, _ = load_model("tiny")
    first = compiled_decoder(model, 30)
    assert first.capacity == 64 and compiled_decoder(model, 64) is first
    assert compiled_decoder(model, 65) is not first and compiled_decoder(model, 65).capacity == 96
    assert compiled_decoder(model, 30, batch=2) is not first


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setattr(compile_cache.sys, "platform", "linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "toyllm"


def test_a_file_digest_is_remembered_until_the_file_changes(cache, tmp_path, monkeypatch):
    model_file = tmp_path / "model.gguf"
    model_file.write_bytes(b"weights" * 1000)
    assert file_digest(model_file) == hashlib.sha256(b"weights" * 1000).hexdigest()
    read = []
    real = compile_cache.sha256_of_file
    monkeypatch.setattr(compile_cache, "sha256_of_file", lambda p: read.append(p) or real(p))
    file_digest(model_file)
    assert read == []                                         # same path, size and time: not read again
    model_file.write_bytes(b"other weights")
    assert file_digest(model_file) == hashlib.sha256(b"other weights").hexdigest() and len(read) == 1


def test_the_key_changes_with_everything_that_changes_the_code(cache, monkeypatch):
    model, _ = load_model("tiny", weights="int8")
    key = step_key(model, 1, 256)
    assert step_key(load_model("tiny", weights="int8")[0], 1, 256) == key      # the same weights, the same key
    others = [step_key(load_model("tiny", weights="int4")[0], 1, 256),
              step_key(load_model("tiny", weights="int8", seed=1)[0], 1, 256),
              step_key(model, 2, 256), step_key(model, 1, 512)]
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    others.append(step_key(model, 1, 256))
    monkeypatch.undo()
    monkeypatch.setenv(CACHE_ENV, str(cache))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "NO AVX")
    others.append(step_key(model, 1, 256))
    monkeypatch.setattr(toyllm.compiled, "COMPILED_STEP_VERSION", 0)
    others.append(step_key(model, 1, 256))
    names = {compile_cache.entry_name(k) for k in [key] + others}
    assert len(names) == len(others) + 1


def test_a_model_read_from_its_file_is_keyed_by_the_file(cache, tmp_path):
    model, _ = load_model("tiny")
    model.gguf_path = str(tmp_path / "model.gguf")
    (tmp_path / "model.gguf").write_bytes(b"gguf")
    assert step_key(model, 1, 256)["weights"] == "gguf sha256:" + hashlib.sha256(b"gguf").hexdigest()


def test_a_second_process_loads_what_the_first_built(cache):
    fake, key = FakeCompiler(), {"step": 1}
    step, report = load_or_build(key, fake.build, fake.load)
    assert (report.how, fake.builds, report.reason) == ("compiled", 1, "") and step == fake.payload
    step, report = load_or_build(key, fake.build, fake.load)
    assert (report.how, fake.builds) == ("loaded", 1) and "loaded from the cache" in report.line()
    assert [e["key"] for e in list_entries()] == [key]
    assert not list((cache / "steps").glob(".building-*"))    # nothing half-written is left behind


@pytest.mark.parametrize("damage, why", [
    (lambda entry: entry.joinpath("step.pt2").write_bytes(b"compiled"), "truncated or replaced"),
    (lambda entry: entry.joinpath("step.pt2").write_bytes(b"x" * 1400), "does not match its recorded sha256"),
    (lambda entry: entry.joinpath("entry.json").write_text("{"), "entry.json cannot be read"),
    (lambda entry: entry.joinpath("step.pt2").unlink(), "step.pt2 is missing"),
    (lambda entry: entry.joinpath("entry.json").write_text(json.dumps(
        {**json.loads(entry.joinpath("entry.json").read_text()), "key": {"step": 0}})), "stale or foreign entry"),
])
def test_a_damaged_or_foreign_entry_is_rebuilt_with_one_line_saying_why(cache, capsys, damage, why):
    fake, key = FakeCompiler(), {"step": 1}
    load_or_build(key, fake.build, fake.load)
    damage(next((cache / "steps").iterdir()))
    step, report = load_or_build(key, fake.build, fake.load)
    assert report.how == "compiled" and fake.builds == 2 and step == fake.payload and why in report.reason
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("compile cache: rebuilding step-") and why in err[0]
    assert load_or_build(key, fake.build, fake.load)[1].how == "loaded"     # the rebuilt entry serves again


def test_an_entry_that_fails_to_load_is_rebuilt(cache, capsys):
    fake, key = FakeCompiler(), {"step": 1}
    load_or_build(key, fake.build, fake.load)
    broken = FakeCompiler(fake.payload)
    broken.load = lambda path: (_ for _ in ()).throw(RuntimeError("wrong torch"))
    with pytest.raises(RuntimeError):                       # the rebuilt one fails too: the error is not hidden
        load_or_build(key, broken.build, broken.load)
    assert "it failed to load (RuntimeError: wrong torch)" in capsys.readouterr().err


def test_no_cache_keeps_nothing_and_clear_empties_the_folder(cache, capsys):
    fake = FakeCompiler()
    _, report = load_or_build({"step": 1}, fake.build, fake.load, use_cache=False)
    assert report.how == "compiled" and not report.cached and list_entries() == []
    load_or_build({"step": 2}, fake.build, fake.load)
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    name = list_entries()[0]["name"]
    assert "1 compiled step(s)" in out and name in out and "unreadable" not in out
    assert main(["cache", "clear", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["freed_bytes"] > len(fake.payload)
    assert list_entries() == [] and compile_cache.cache_bytes() == 0


@pytest.mark.parametrize("argv, message", [
    (["--compile", "ahead", "--weights", "fp16"], "--compile ahead --weights fp16: compile='ahead' needs weight "
                                                  "kernels that are ATen operators (formats fp32, int8, int4)"),
    (["--compile", "jit", "--cache", "static"], "leave out --method naive, --cache and --headroom"),
    (["--compile", "ahead", "--method", "naive"], "leave out --method naive, --cache and --headroom"),
    (["--compile", "jit", "--attention", "causal"], "--attention causal applies to --compile off"),
    (["--no-cache"], "--no-cache applies to a compiled step"),
    (["--compile", "aot"], "argument --compile: invalid choice: 'aot'"),
])
def test_bad_compile_flags_get_one_clear_line(cache, capsys, argv, message):
    assert main(["generate", "--model", "tiny", "--prompt", "hi"] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_generate_compile_prints_how_the_step_was_made_and_the_eager_tokens(cache, capsys, monkeypatch):
    """The command line's path without a compiler: the step's build is a stand-in that runs the eager function."""
    built = []

    def build(self):
        built.append(self.cache)
        self._compiled = self._forward
        self.report = compile_cache.CompileReport("loaded", 1.5, "ahead", True, cache / "steps" / "step-x")
        return self.report

    monkeypatch.setattr(CompiledDecoder, "build", build)
    flags = ["generate", "--model", "tiny", "--prompt", "hello", "--max-new-tokens", "6", "--json"]
    assert main(flags + ["--weights", "int8"]) == 0
    eager = json.loads(capsys.readouterr().out)
    assert main(flags + ["--weights", "int8", "--compile", "ahead", "--no-cache"]) == 0
    fast = json.loads(capsys.readouterr().out)
    assert fast["output_ids"] == eager["output_ids"] and built == [False]
    assert fast["compile"] == "ahead" and fast["compile_report"]["how"] == "loaded"
    assert main(flags[:-1] + ["--compile", "jit"]) == 0
    assert "loaded from the cache in 1.5 s" in capsys.readouterr().out and built == [False, True]


@pytest.mark.slow
def test_a_step_compiled_ahead_is_loaded_by_the_next_model_and_answers_as_eager(cache):
    """The one real compile here (tiny, int4, about 20 s): a second model object, as in a second process,
    loads the kept package instead of compiling, and its tokens and logits are the eager ones."""
    first, _ = load_model("tiny", weights="int4")
    assert compiled_decoder(first, len(PROMPT) + 8, ahead_of_time=True).build().how == "compiled"
    model, _ = load_model("tiny", weights="int4")
    decoder = compiled_decoder(model, len(PROMPT) + 8, ahead_of_time=True)
    assert decoder.build().how == "loaded" and len(list_entries()) == 1
    ahead = generate(model, PROMPT, 8, compile="ahead", return_logits=True)
    eager = generate(model, PROMPT, 8, return_logits=True)
    assert ahead.output_ids == eager.output_ids
    for a, b in zip(ahead.logits, eager.logits):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=0)      # int4's kernel rounds activations to bfloat16
    clear_cache()
    assert list_entries() == []
