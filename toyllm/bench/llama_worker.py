"""llama.cpp, timed in its own process: the worker that ``toyllm.bench.llama`` starts.

Run as a script by an interpreter that has llama-cpp-python (which may not
be toyllm's own: llama-cpp-python is an optional install, never in the
lock), so it imports nothing from toyllm. It loads one GGUF file and then
answers one JSON request per line on stdin with one JSON line on stdout:

- ``{"op": "decode", "ids": [...], "new_tokens": n}``: prefill ``ids``,
  then ``n - 1`` greedy decode steps, one token each; returns the tokens
  and the seconds of each step (the prefill apart).
- ``{"op": "prefill", "ids": [...]}``: the seconds to prefill ``ids`` into
  an empty cache.
- ``{"op": "quit"}``.

Its first line says it is ready, with llama.cpp's version and the CPU
features it was built for. A request that fails is answered with
``{"error": "..."}`` and the worker waits for the next one; a crash here
(llama.cpp built for instructions this CPU lacks dies at its first token)
costs the benchmark one row, not the report. Replies go to the stdout the
worker started with; whatever llama.cpp itself prints goes to stderr, so it
can never be mistaken for a reply.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", help="path of the GGUF file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=8192, help="tokens the context holds")
    args = parser.parse_args()

    # The replies keep the original stdout; file descriptor 1 becomes stderr, so that a line printed by
    # llama.cpp's C code (which writes to fd 1 directly) cannot land in the middle of the protocol.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import numpy as np
    import llama_cpp

    llm = llama_cpp.Llama(args.gguf, n_ctx=args.context, n_batch=512, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False)
    vocab = llm.n_vocab()

    def last_logits():
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(vocab,))

    def reply(obj) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    def answer(request: dict) -> dict:
        ids = [int(t) for t in request["ids"]]
        llm.reset()                                    # an empty cache: the next eval starts at position 0
        t0 = time.perf_counter()
        llm.eval(ids)
        prefill_s = time.perf_counter() - t0
        if request["op"] == "prefill":
            return {"seconds": prefill_s}
        tokens, step_s = [int(np.argmax(last_logits()))], []
        for _ in range(int(request["new_tokens"]) - 1):
            t0 = time.perf_counter()
            llm.eval([tokens[-1]])
            tokens.append(int(np.argmax(last_logits())))
            step_s.append(time.perf_counter() - t0)
        return {"tokens": tokens, "step_s": step_s, "prefill_s": prefill_s}

    info = llama_cpp.llama_print_system_info()
    reply({"ready": True, "version": llama_cpp.__version__,
           "system_info": info.decode() if isinstance(info, bytes) else str(info)})
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "quit":
            break
        if request.get("op") not in ("decode", "prefill"):
            reply({"error": f"unknown op {request.get('op')!r}"})
            continue
        try:
            reply(answer(request))
        except Exception as exc:       # a context too short, a bad id: this request fails, not the worker
            reply({"error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    main()
