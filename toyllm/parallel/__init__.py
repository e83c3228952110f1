"""Parallel prefill across processes: TSP, KV-Runahead (KVR) and ring attention.

The prompt of C tokens is cut into chunks c_0..c_{p-1}, one per rank; rank i
owns tokens [s_i, s_i + c_i) with s_i = c_0 + ... + c_{i-1}. Every rank runs
all layers on its own tokens with the single-device model's three steps
(``Block.qkv``, ``Block.attend``, ``Block.finish``); the model itself knows
nothing of processes. The methods differ only in how a rank gets the keys
and values of the tokens before its chunk:

- **TSP** (tensor/sequence parallel): every rank all-gathers everyone's K,V
  and attends its c_i queries over all C keys, masking the future. Dot
  products per rank: c_i * C. Every rank waits for the slowest.
- **KVR** (KV-Runahead): rank i receives the K,V of tokens [0, s_i) from
  rank i-1, appends its own, attends over those s_i + c_i keys, and sends
  the grown prefix on to rank i+1. Dot products: c_i * (s_i + c_i); only
  point-to-point messages; the last rank ends up holding the KV cache of
  the whole context, produces the first token and keeps decoding.
- **ring** (ring attention): every rank keeps its queries and the key/value
  blocks go round a ring, rank to rank, in p - 1 steps, each overlapped with
  attention on the block in hand; partial outputs merge by their
  log-sum-exps, and blocks wholly in a rank's future are skipped (zigzag
  balances the work). Pass-Q instead sends the queries round, to continue
  a prompt whose earlier tokens are already cached on the ranks.

Three layers, each readable on its own:

- ``steps``: the algorithms, one layer of TSP or KVR in about a dozen lines;
- ``ring``: ring attention's two steps (pass-KV, pass-Q), the attention of
  one block with its log-sum-exp, and the rule for choosing what to pass;
- ``comm``: the communication objects (all-gather, the KVR chain with
  blocking or overlapped sends and receives, the ring, a simulated slow link);
- ``runner``: checking a request, starting the processes, timing repeated
  runs, timelines, decoding afterwards, merging the results (``plug``:
  naming your own step so that every process finds it);
- ``link``: measuring the real link between two ranks (bandwidth and
  latency), for the simulator's cost model.
"""
from .comm import AllGather, Chain, LinkModel, Ring
from .link import LinkMeasurement, measure_link
from .runner import (METHODS, ModelSpec, PrefillResult, check_prefill_request, measured_cost,
                     parallel_prefill, prefill_rank, single_prefill, torchrun_main)
from .ring import RING_BALANCES, RING_PASSES, ring_pass_kv_layer, ring_pass_q_layer, ring_traffic
from .steps import (TSP_BALANCES, RankPositions, default_step, kvr_layer, kvr_layer_blocking, tsp_layer,
                    tsp_trimmed_layer, tsp_zigzag_layer)

__all__ = ["AllGather", "Chain", "LinkModel", "Ring", "RING_BALANCES", "RING_PASSES",
           "ring_pass_kv_layer", "ring_pass_q_layer", "ring_traffic", "LinkMeasurement", "measure_link", "METHODS",
           "ModelSpec",
           "PrefillResult", "check_prefill_request", "measured_cost", "parallel_prefill", "prefill_rank", "single_prefill", "torchrun_main",
           "TSP_BALANCES", "RankPositions", "default_step", "kvr_layer", "kvr_layer_blocking", "tsp_layer",
           "tsp_trimmed_layer", "tsp_zigzag_layer"]
