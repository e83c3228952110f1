"""Weight formats (toyllm.quant): exact byte counts, per-channel int8, fidelity to float32."""
import pytest
import torch
import torch.nn as nn

import toyllm.quant as quant
from toyllm import generate, load_model
from toyllm.quant import (BF16Linear, FP16Linear, Int4Linear, Int8Linear, WEIGHT_FORMATS, convert_linears,
                          int4_blocks, int8_per_channel, linear_kernel, linear_weight_bytes, weight_format)
from toyllm.utils import random_prompt

# A fixed English text for teacher forcing (at least 256 SmolLM2 tokens).
TEXT = (
    "The river starts high in the mountains, where snow melts in the spring and runs down in small streams. "
    "Over many miles the streams join, and by the time the water reaches the first town it is wide enough for boats. "
    "People have lived along its banks for thousands of years. They fished in it, drank from it, and used it to carry "
    "wood, grain and stone to the cities on the coast. Mills were built where the current was strong, and bridges "
    "where the banks were close. In the last century the river was straightened in places to make shipping easier, "
    "and dams were built to produce electricity and to hold back floods. Some of these changes helped the towns grow, "
    "but they also changed the life of the river itself. Fish that once swam upstream to lay their eggs could no "
    "longer pass the dams, and the wetlands that had filtered the water dried out. Today engineers and scientists are "
    "trying to undo part of the damage. They build ladders that let fish climb past the dams, and they let the river "
    "flood some of its old meadows again. Children from the schools nearby count birds and measure the water every "
    "month, and the numbers they collect show that the river is slowly getting cleaner. It will never be quite what "
    "it was, but it is alive, and on summer evenings the whole town walks along its banks.")
POSITIONS = 256
MIN_TOP1_AGREEMENT = 0.9


def _tiny_linears():
    cfg = load_model("tiny")[0].config
    # q, k, v, o and the three MLP matrices of each layer, plus the (untied) output projection
    return cfg, cfg.n_layers * cfg.matmul_params_per_layer + cfg.vocab_size * cfg.d_model


@pytest.mark.parametrize("weights", ["fp64", "int2", "", "FP32"])
def test_unknown_weight_format_is_rejected(weights):
    with pytest.raises(ValueError, match=r"unknown weight format weights=.*choose one of "
                                         r"\['fp32', 'bf16', 'fp16', 'int8', 'int4'\]"):
        load_model("tiny", weights=weights)
    with pytest.raises(ValueError, match="unknown weight format"):
        convert_linears(load_model("tiny")[0], weights)


@pytest.mark.parametrize("weights", WEIGHT_FORMATS)
def test_bytes_per_weight_are_exact(weights):
    cfg, n = _tiny_linears()
    model, _ = load_model("tiny", weights=weights)
    assert weight_format(model) == weights
    out_channels = cfg.n_layers * (cfg.n_heads * cfg.head_dim + 2 * cfg.n_kv_heads * cfg.head_dim + cfg.d_model
                                   + 2 * cfg.ffn_dim + cfg.d_model) + cfg.vocab_size
    head = cfg.vocab_size * cfg.d_model
    expected = {"fp32": 4 * n, "bf16": 2 * n, "fp16": 2 * n, "int8": n + 2 * out_channels,   # bf16 scales
                # half a byte per layer weight, a bf16 scale and zero per 32; the output projection in int8
                "int4": (n - head) // 2 + (n - head) // 32 * 4 + head + 2 * cfg.vocab_size}[weights]
    assert linear_weight_bytes(model) == expected
    if weights != "fp32":
        assert not any(isinstance(m, nn.Linear) for m in model.modules())


def test_int8_per_channel_rounds_each_row_to_its_own_scale():
    w = torch.tensor([[0.5, -1.0, 0.25], [100.0, 3.0, -50.0]])
    q, scale = int8_per_channel(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    torch.testing.assert_close(scale, torch.tensor([1.0 / 127, 100.0 / 127]))
    assert q.tolist() == [[64, -127, 32], [127, 4, -64]]          # round(w / scale), the row maximum at +-127
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 48, generator=g) * torch.logspace(-3, 1, 64)[:, None]   # rows of very different size
    q, scale = int8_per_channel(w)
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()                # at most half a step of that row's scale


def test_int4_blocks_round_each_block_of_32_to_its_own_range():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(48, 96, generator=g) * torch.logspace(-3, 1, 48)[:, None]   # rows of very different size
    q, scale, low = int4_blocks(w)
    assert q.dtype == torch.uint8 and q.shape == (48, 96) and scale.shape == low.shape == (48, 3)
    assert q.min() == 0 and q.max() == 15
    blocks = w.reshape(48, 3, 32)
    torch.testing.assert_close(low, blocks.amin(-1))                               # the minimum maps to 0
    torch.testing.assert_close(scale, (blocks.amax(-1) - low) / 15)               # the maximum to 15
    back = q.float().reshape(48, 3, 32) * scale[..., None] + low[..., None]
    assert ((back - blocks).abs() <= scale[..., None] / 2 + 1e-6).all()            # half a step of its own block
    # A block made the way GGUF's Q4_1 makes them (scale * code + minimum, codes 0 and 15 present) gives back its codes.
    codes = torch.randint(0, 16, (8, 64), generator=g)
    codes[:, ::32], codes[:, 1::32] = 0, 15
    d, m = torch.rand(8, 2, 1, generator=g) * 0.01, torch.randn(8, 2, 1, generator=g) * 0.1
    made = (codes.float().reshape(8, 2, 32) * d + m).reshape(8, 64)
    assert torch.equal(int4_blocks(made)[0], codes.to(torch.uint8))


def test_int4_needs_inputs_in_whole_blocks():
    with pytest.raises(ValueError, match="int4 needs the input size to be a multiple of 32; this layer has 40 inputs"):
        Int4Linear(torch.randn(8, 40))


def test_int4_matches_its_own_stored_weights_and_keeps_an_int8_output_projection():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 64, generator=g) * 0.1
    x = torch.randn(2, 5, 64, generator=g)
    q, scale, low = int4_blocks(w)
    stored = (q.float().reshape(96, 2, 32) * scale[..., None] + low[..., None]).reshape(96, 64)
    y = Int4Linear(w)(x)
    assert y.shape == (2, 5, 96) and y.dtype == torch.float32
    torch.testing.assert_close(y, x @ stored.T, atol=2e-2, rtol=0)              # bf16 activations, scales, outputs
    model, _ = load_model("tiny", weights="int4")
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.exact_top > 0
    assert isinstance(model.layers[0].mlp.w_gate_up, Int4Linear)
    assert linear_kernel(model) == "int4pack+int8pack" and linear_kernel(load_model("tiny")[0]) == "F.linear"


@pytest.mark.parametrize("cls, atol", [(BF16Linear, 2e-2), (FP16Linear, 1e-3), (Int8Linear, 3e-2)])
def test_converted_linear_matches_float32(cls, atol):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g) * 0.1
    x = torch.randn(2, 5, 64, generator=g)                         # (B, T, in): any leading dims
    ref = x @ w.T
    y = cls(w)(x)
    assert y.shape == (2, 5, 96) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, atol=atol, rtol=0)
    assert (y - ref).abs().max() > 0 or cls is FP16Linear          # the formats really round


@pytest.mark.parametrize("cls", [BF16Linear, Int8Linear])
def test_exact_top_recomputes_the_largest_outputs_in_float32(cls):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(500, 64, generator=g)
    x = torch.randn(3, 1, 64, generator=g)
    layer = cls(w, exact_top=8)
    stored = layer.rows(torch.arange(500))                          # (500, 64): the weights as the layer keeps them
    exact = x @ stored.T                                            # float32 products of the stored weights
    y = layer(x)
    top = y.topk(8, dim=-1).indices
    torch.testing.assert_close(y.gather(-1, top), exact.gather(-1, top), atol=1e-5, rtol=1e-6)
    assert (cls(w)(x) - exact).abs().max() > 1e-3                   # without it, outputs carry bf16 rounding


def test_portable_kernels_give_the_same_results(monkeypatch):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(80, 64, generator=g) * 0.1
    x = torch.randn(4, 64, generator=g)
    fast = {cls: cls(w)(x) for cls in (BF16Linear, FP16Linear)}
    monkeypatch.setattr(quant, "_fbgemm", lambda: False)
    monkeypatch.setattr(quant, "_onednn_bf16", lambda: False)
    for cls, y in fast.items():
        layer = cls(w)
        assert layer.kernel == "F.linear"
        torch.testing.assert_close(layer(x), y, atol=1e-3, rtol=8e-3)   # one bfloat16 step is 2^-8 relative


@pytest.mark.parametrize("weights", ["bf16", "fp16", "int8", "int4"])
def test_formats_on_tiny_generate_and_agree_with_float32(weights):
    ref, _ = load_model("tiny")
    model, _ = load_model("tiny", weights=weights)
    ids = torch.tensor([random_prompt(200, 256, seed=7)])
    agree = (model(ids).argmax(-1) == ref(ids).argmax(-1)).float().mean().item()
    assert agree >= MIN_TOP1_AGREEMENT
    prompt = random_prompt(16, 256)
    naive = generate(model, prompt, 12, method="naive")
    assert generate(model, prompt, 12).output_ids == naive.output_ids


# --------------------------------------------------------------------------- SmolLM2

@pytest.fixture(scope="module")
def smollm2_reference(smollm2):
    """float32's teacher-forced top-1 predictions and greedy chat answer."""
    model, tok = smollm2
    ids = tok.encode(TEXT)
    assert len(ids) >= POSITIONS
    ids = torch.tensor([ids[:POSITIONS]])
    answer = generate(model, tok.encode_chat("What is the capital of France?"), 40, eos_id=tok.eos_id)
    return ids, model(ids)[0].argmax(-1), answer.output_ids


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["bf16", "fp16", "int8", "int4"])
def test_smollm2_formats_keep_the_greedy_answer_and_top1(smollm2, smollm2_reference, weights):
    _, tok = smollm2
    ids, ref_top1, ref_answer = smollm2_reference
    model, _ = load_model("smollm2-135m", weights=weights)
    answer = generate(model, tok.encode_chat("What is the capital of France?"), 40, eos_id=tok.eos_id).output_ids
    assert answer == ref_answer, tok.decode(answer)
    assert "Paris" in tok.decode(answer)
    agree = (model(ids)[0].argmax(-1) == ref_top1).float().mean().item()
    assert agree >= MIN_TOP1_AGREEMENT, f"{weights}: {agree:.1%} top-1 agreement over {POSITIONS} positions"


# --------------------------------------------------------------------------- command line and benchmark helpers

def test_cli_generate_takes_weights(capsys):
    import json

    from toyllm.cli import main

    assert main(["generate", "--model", "tiny", "--prompt", "hi", "--weights", "int8", "--json",
                 "--max-new-tokens", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weights"] == "int8" and len(out["output_ids"]) == 3
    assert main(["generate", "--model", "tiny", "--prompt", "hi", "--weights", "fp64"]) == 2
    err = capsys.readouterr().err
    assert "--weights" in err and "fp64" in err and "int8" in err


def test_decode_bytes_per_token_counts_weights_embedding_row_and_kv():
    from toyllm.bench.decode import decode_bytes_per_token

    model, _ = load_model("tiny", weights="bf16")
    cfg = model.config
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 100 * 4
    assert decode_bytes_per_token(model, 100) == linear_weight_bytes(model) + 4 * cfg.d_model + kv
    assert decode_bytes_per_token(model, 100, batch=3) == linear_weight_bytes(model) + 3 * (4 * cfg.d_model + kv)


def test_the_weights_and_batched_sections_render_their_verdicts_from_the_numbers():
    from toyllm.bench import add_floor_figures, render_section
    from toyllm.bench.decode import BLOG_TOY
    from test_bench_report import _five
    from toyllm.measure import compare, spread

    fp32_runs = [0.099, 0.0995, 0.100, 0.1005, 0.101]    # seconds per token, round by round
    rows = [add_floor_figures({"format": f, "kernel": "k", "bytes_per_token": b, "linear_bytes": b, "tokens_per_s": t,
                               "runs_s": r, "products_s": ps, "products_runs_s": [ps * 0.98, ps * 1.02],
                               "calls_per_step": 1000, "vs_fp32": compare(r, fp32_runs), "paris": p, "same_as_fp32": p},
                              1e9)
            for f, b, t, r, ps, p in [("fp32", 5.4e8, 10.0, fp32_runs, 0.08, True),
                                      ("bf16", 2.7e8, 15.0, _five([0.0658, 0.06645, 0.0671]), 0.05, True),
                                      ("int8", 1.4e8, 30.0, _five([0.033, 0.03335, 0.0337]), 0.02, False)]]
    weights = {"bandwidth_bytes_per_s": 1e9, "threads": 2, "prompt_len": 37, "new_tokens": 16, "rounds": 2,
               "attention": "dense", "rows": rows, "best": rows[1], "at_floor": ["fp32", "bf16", "int8"],
               "capability": "AVX512", "floor_target": 0.65}
    text = render_section("weights", weights)
    assert "| bf16 | k | 270 | 3.7 | 15.0 [14.9-15.2] | 405% | 1.50x faster | yes | yes |" in text
    assert "| int8 | k | 140 | 7.1 | 30.0 [29.7-30.3] | 420% | 3.00x faster | no | no |" in text
    assert 'still answers "Paris" is bf16: 15.0 tokens/s, 1.50x faster than float32' in text
    assert "At or above the floor: fp32, bf16, int8" in text and "No format reaches" not in text
    # where the step goes: 66.67 ms per token, 50 ms of products reading 270 MB (5.4 GB/s), the rest over 1000 calls
    assert "| bf16 | 66.67 | 50.00 [49.00-51.00] | 5.4 | 540% | 16.67 | 1000 | 16.7 |" in text
    assert "bf16 reaches 405%, which meets it." in text and "out of reach" not in text
    # a format whose products alone stay below the target: out of reach with its kernel, said from the numbers
    slow = add_floor_figures({**rows[1], "tokens_per_s": 2.0, "products_s": 0.4, "products_runs_s": [0.4]}, 1e9)
    text = render_section("weights", {**weights, "rows": [slow], "best": slow})
    assert "bf16 reaches 54%, which does not meet it." in text
    assert "even a step that did nothing else would reach 68% of the floor" not in text
    assert "would allow 68%; the rest of the step, 100.00 ms over 1000 operator calls (about 100.0 us per call)" in text
    slower = add_floor_figures({**slow, "products_s": 0.45}, 1e9)
    text = render_section("weights", {**weights, "rows": [slower], "best": slower})
    assert "even a step that did nothing else would reach 60% of the floor, so with this kernel" in text
    assert "The rest adds 50.00 ms over 1000 operator calls, about 50.0 us per call." in text
    # the copies ran at several speeds: out of reach only if even the slowest round's floor keeps it below
    varied = {**weights, "bandwidth_runs": [0.95e9, 1e9, 1.6e9]}
    text = render_section("weights", {**varied, "rows": [slower], "best": add_floor_figures(dict(slower), 1e9, 0.95e9)})
    assert "reach 60% of the floor (63% against the slowest round's copy, 0.9 GB/s, the floor most in its favour)" in text
    assert "out of reach" in text and "Bandwidth measured at the start of every round" in text and "[0.9-1.6]" in text
    text = render_section("weights", {**varied, "rows": [slower], "best": add_floor_figures(dict(slower), 1e9, 0.8e9)})
    assert "out of reach" not in text and "would allow 60%" in text
    assert "No format answered" in render_section("weights", {**weights, "best": None})
    def against(cache, naive, cached_runs):
        cached = spread(cached_runs)
        return {"cache": cache, "cached": cached, "cached_s": cached.median, "speedup": naive.median / cached.median,
                "identical": True, "round_speedups": [a / b for a, b in zip(naive.runs, cached_runs)]}

    def batched(naive_runs, cached_runs, **more):
        naive = spread(naive_runs)
        return render_section("batched", {
            "prompts": 10, "prompt_len": 50, "new_tokens": 100, "config": BLOG_TOY.to_dict(), "threads": 2,
            "warmup": 1, "naive": naive, "naive_s": naive.median, **against("dynamic", naive, cached_runs), **more})

    text = batched([3.0, 2.9, 3.3], [0.25, 0.24, 0.26])
    assert "| 10 x 50 | dynamic (the blog's) | - | 3.00 [2.90-3.30] | 0.25 [0.24-0.26] | 12.0x | 12.0-12.7x | True |" \
        in text
    assert "after an untimed round of each" in text and "Why they differ" not in text
    assert "Against the blog's cache" not in text and "headroom h" not in text
    assert "- dynamic (the blog's): 12.00x (the medians), missed in every round." in text
    assert "target (the blog measured 22x" in text

    def other(cache, cached_runs, copies):
        return {**against(cache, spread([3.0, 2.9, 3.3]), cached_runs), "copies": copies,
                "against_blog": compare(_five(cached_runs), _five([0.25, 0.24, 0.26]))}

    gaps = [0, 4, 198]
    runs = [spread(_five(r)) for r in ([0.0068, 0.0070, 0.0072], [0.0100, 0.0101, 0.0104], [0.0155, 0.0160, 0.0170])]
    text = batched([3.0, 2.9, 3.3], [0.25, 0.24, 0.26], copies=99,
                   other_caches=[other("dynamic, headroom=4", [0.14, 0.13, 0.15], 19),
                                 other("static", [0.30, 0.29, 0.31], 0)],
                   products={"cached_tokens": 100, "capacity": 298, "gaps": gaps, "runs": runs,
                             "verdict": compare(runs[0], runs[-1])})
    assert "| 10 x 50 | dynamic (the blog's) | 99 | 3.00 [2.90-3.30] | 0.25 [0.24-0.26] | 12.0x |" in text
    assert "| 10 x 50 | dynamic, headroom=4 | 19 | 3.00 [2.90-3.30] | 0.14 [0.13-0.15] | 21.4x | 21.4-22.3x |" in text
    assert "| 10 x 50 | static | 0 | 3.00 [2.90-3.30] | 0.30 [0.29-0.31] | 10.0x | 10.0-10.6x | True |" in text
    assert "- dynamic, headroom=4: 21.43x (the medians), met in every round." in text
    assert "- static: 10.00x (the medians), missed in every round." in text
    assert "- `dynamic, headroom=4` 140.0 ms [130.0-150.0 ms] vs the blog's cache 250.0 ms [240.0-260.0 ms]: " \
           "`dynamic, headroom=4` is 1.79x faster (5 rounds, p = 0.0079)." in text
    assert "- `static` 300.0 ms [290.0-310.0 ms] vs the blog's cache 250.0 ms [240.0-260.0 ms]: `static` is 1.20x " \
           "slower (5 rounds, p = 0.0079)." in text
    assert "The fastest cache here was dynamic, headroom=4, 21.43x faster than recomputing" in text
    assert "| rows between sequences | 0 | 4 | 198 |" in text
    assert "| both products (ms) | 7.0 [6.8-7.2] | 10.1 [10.0-10.4] | 16.0 [15.5-17.0] |" in text
    assert "slots of 298 rows leave 198 at this length" in text and "one decode step at 100 cached tokens" in text
    assert "0 rows apart 7.0 ms [6.8-7.2 ms] vs 198 rows apart 16.0 ms [15.5-17.0 ms]: 0 rows apart is 2.29x " \
           "faster (5 rounds, p = 0.0079). So the static cache saves the copies" in text
    tie = [spread(_five([0.0068, 0.0070, 0.0072]))] * 3
    text = batched([3.0, 2.9, 3.3], [0.25, 0.24, 0.26], other_caches=[other("static", [0.30, 0.29, 0.31], 0)],
                   products={"cached_tokens": 100, "capacity": 298, "gaps": gaps, "runs": tie,
                             "verdict": compare(tie[0], tie[-1])})
    assert "a tie" in text and "did not decide the products' time" in text and "saves the copies" not in text
    assert "met in every round" in batched([5.0, 5.2, 5.4], [0.24, 0.25, 0.26])
    assert "met in some rounds and missed in others" in batched([4.0, 5.2, 5.4], [0.24, 0.25, 0.26])


@pytest.mark.parametrize("weights, exact", [("bf16", True), ("int8", True), ("fp16", False)])
def test_only_a_bf16_output_projection_recomputes_its_top_logits(weights, exact):
    model, _ = load_model("tiny", weights=weights)
    assert model.lm_head.exact_top == (quant.EXACT_TOP_LOGITS if exact else 0)
    assert all(m.exact_top == 0 for m in model.layers.modules() if isinstance(m, quant._ConvertedLinear))
