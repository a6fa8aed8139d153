"""bench/gpu_check.py's Markdown report: one table per section, from the JSON report's rows."""

from __future__ import annotations

# issue #6: decode speedup over the bf16 pool of the same batch at the target context (32k)
QUANT_TARGETS = {"fp8_e4m3": 1.7, "int8": 1.7, "int4": 2.5}


def _cell(row, name, key, spec):
    if f"{name}_error" in row:
        return "error"
    return format(row[f"{name}_{key}"], spec) if f"{name}_{key}" in row else "-"


def _line(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def fmt_decode_row(row) -> str:
    cells = [str(row["batch"]), str(row["context"]), str(row["group"])]
    for name in ("ours", "ragged", "peer"):
        cells += [_cell(row, name, "ms", ".4f"),
                  f"{_cell(row, name, 'min_ms', '.4f')}–{_cell(row, name, 'max_ms', '.4f')}",
                  _cell(row, name, "gbps", ".0f"), _cell(row, name, "frac_copy", ".2f")]
    return _line(cells)


def fmt_quant_row(row) -> str:
    """| batch | context | GQA | kv dtype | ms | spread | GB/s | frac | bytes vs bf16 | bf16 ms |
    speedup | target |"""
    if "target" in row:
        target = f"≥ {row['target']}× " + ("pass" if row["target_met"] else "**fail**")
    else:
        target = "-"
    speedup = row.get("speedup_vs_bf16")
    return _line([str(row["batch"]), str(row["context"]), str(row["group"]),
                  row["kv_cache_dtype"], _cell(row, "ours", "ms", ".4f"),
                  f"{_cell(row, 'ours', 'min_ms', '.4f')}–{_cell(row, 'ours', 'max_ms', '.4f')}",
                  _cell(row, "ours", "gbps", ".0f"), _cell(row, "ours", "frac_copy", ".2f"),
                  f"{row['kv_bytes'] / row['bf16_kv_bytes']:.3f}", f"{row['bf16_ms']:.4f}",
                  "error" if speedup is None else f"×{speedup:.2f}", target])


def fmt_sparse_row(row) -> str:
    """| batch | context | budget | pages read | MB read (kernel / step) | of dense | dense ms |
    kernel ms | GB/s | speed-up | step ms | GB/s | speed-up | max err | ok |"""
    head = [str(row["batch"]), str(row["context"]), str(row.get("budget_tokens", "-"))]
    if "dense_error" in row or "error" in row:
        return _line(head + [f"error: {row.get('error', row.get('dense_error'))}"] + [""] * 11)
    cells = head + [str(row["pages_read"]),
                    f"{row['kernel_bytes'] / 1e6:.1f} / {row['quest_bytes'] / 1e6:.1f}",
                    f"{row['quest_bytes'] / row['dense_bytes']:.3f}", f"{row['dense_ms']:.4f}"]
    for name in ("kernel", "quest"):
        cells += [f"{row[f'{name}_ms']:.4f}", f"{row[f'{name}_gbps']:.0f}",
                  f"×{row[f'{name}_speedup']:.2f}"]
    return _line(cells + [f"{row['max_err']:.2e}", str(row["ok"])])


def _kept_vs_dense(row) -> list[str]:
    """The cells of a kept-vs-dense row after its head: ms, spread, GB/s (and the kept one's
    fraction of copy) of each, the speed-up, the max error, ok."""
    cells = []
    for name in ("kept", "dense"):
        cells += [f"{row[f'{name}_ms']:.4f}",
                  f"{row[f'{name}_min_ms']:.4f}–{row[f'{name}_max_ms']:.4f}",
                  f"{row[f'{name}_gbps']:.0f}"]
        if name == "kept":
            cells.append(f"{row['kept_frac_copy']:.2f}")
    return cells + [f"×{row['speedup']:.2f}", f"{row['max_err']:.2e}", str(row["ok"])]


def fmt_kept_row(row) -> str:
    """| batch | context | pages kept | MB read (kept / dense) | kept ms | spread | GB/s | frac |
    dense ms | spread | GB/s | speed-up | max err | ok |"""
    head = [str(row["batch"]), str(row["context"])]
    if "error" in row:
        return _line(head + [f"error: {row['error']}"] + [""] * 11)
    cells = head + [f"{row['kept_pages']} / {row['logical_pages']}",
                    f"{row['kept_bytes'] / 1e6:.1f} / {row['dense_bytes'] / 1e6:.1f}"]
    return _line(cells + _kept_vs_dense(row))


def fmt_mla_row(row) -> str:
    """| batch | context | heads | MB read (bf16 / fp8) | ours ms | spread | GB/s | frac | h64 ms |
    spread | GB/s | frac | fp8 ms | spread | GB/s | frac | max err (bf16 / fp8) | ok |"""
    head = [str(row["batch"]), str(row["context"]), str(row["heads"])]
    if "error" in row:
        return _line(head + [f"error: {row['error']}"] + [""] * 14)
    cells = head + [f"{row['latent_bytes'] / 1e6:.1f} / {row['fp8_bytes'] / 1e6:.1f}"]
    for name in ("ours", "h64", "fp8"):
        cells += [_cell(row, name, "ms", ".4f"),
                  f"{_cell(row, name, 'min_ms', '.4f')}–{_cell(row, name, 'max_ms', '.4f')}",
                  _cell(row, name, "gbps", ".0f"), _cell(row, name, "frac_copy", ".2f")]
    err = " / ".join(f"{row[k]:.2e}" if k in row else "-" for k in ("max_err", "fp8_max_err"))
    return _line(cells + [err, str(row["ok"])])


def fmt_weight_row(row) -> str:
    """| weight | type | batch | MB (stored / bf16) | kept ms | spread | GB/s | frac | bf16 ms |
    spread | GB/s | speed-up | max err | ok |"""
    head = [f"{row['size']}x{row['size']}", row["qtype"], str(row["batch"])]
    if "error" in row:
        return _line(head + [f"error: {row['error']}"] + [""] * 10)
    cells = head + [f"{row['stored_bytes'] / 1e6:.1f} / {row['dense_bytes'] / 1e6:.1f}"]
    return _line(cells + _kept_vs_dense(row))


def fmt_e2e_row(row) -> str:
    """| model | KV | batch | prompt | output | steps (decode) | tokens/s | decode step ms |
    device ms | host ms | host share | host share, all steps | attention | recompiles | ok |"""
    head = [row["model"], row["kv_cache_dtype"], str(row["batch"])]
    if "error" in row:
        return _line(head + [f"error: {row['error']}"] + [""] * 11)
    return _line(head + [
        str(row["prompt_tokens"]), str(row["output_tokens"]),
        f"{row['steps']} ({row['decode_steps']})", f"{row['tokens_per_s']:.0f}",
        f"{row['decode_step_ms']:.3f}", f"{row['decode_device_ms']:.3f}",
        f"{row['decode_host_ms']:.3f}", f"{row['host_share']:.2f}",
        f"{row['host_share_all']:.2f}", row["attention_impl"], str(row["recompiles"]),
        str(row["ok"])])


def quant_target_summary(rows) -> list[str]:
    """One line per dtype with a target: at how many batches of the target context it is met."""
    lines = []
    for kv, target in QUANT_TARGETS.items():
        judged = [r for r in rows if r["kv_cache_dtype"] == kv and "target" in r]
        if not judged:
            continue
        met = [r for r in judged if r["target_met"]]
        speedups = [r["speedup_vs_bf16"] for r in judged]
        verdict = "pass" if len(met) == len(judged) else "**fail**"
        failing = ", ".join(str(r["batch"]) for r in judged if not r["target_met"]) or "none"
        lines.append(f"* {kv} ≥ {target}× at context {judged[0]['context']}: {verdict} — met at "
                     f"{len(met)}/{len(judged)} batches (speedup ×{min(speedups):.2f}–"
                     f"×{max(speedups):.2f}; failing batches: {failing})")
    return lines


def run_lines(report) -> list[str]:
    mode = ("dry run, " if report["dry_run"] else "") + ("quick" if report["quick"] else "full")
    sections = ", ".join(f"{k} {v:.0f} s" for k, v in report["sections_s"].items())
    skipped = ", ".join(f"{n} after the {g} guard" for g, n in report["skipped"].items())
    return [f"# jaxkv GPU check — {report['device']}, jax {report['jax']}", "",
            f"{mode}; device-to-device copy bandwidth: **{report['copy_gbps']:.0f} GB/s**; "
            f"run took {report['elapsed_s']:.0f} s ({sections}); rows dropped by a time guard: "
            f"{skipped or 'none'}."]


def correctness_lines(report) -> list[str]:
    lines = ["", "## (a) correctness vs reference (written = a KIVI pool filled through "
             "cache.write, sequences ending in unsealed blocks read from the residual; sealed "
             "KIVI and fp8/int8 pools from quantize_pages)", "",
             "| kernel | pool | options | dtype | max abs err | ok |", "|---|---|---|---|---|---|"]
    return lines + [f"| {r['kernel']} | {r['pool']} | {r['variant']} | {r['dtype']} | "
                    f"{r['max_err']:.2e} | {r['ok']} |"
                    for rows in report["correctness"].values() for r in rows]


def decode_lines(report) -> list[str]:
    lines = ["", f"## (b) decode, bf16, head_dim {report['head_dim']} (ms per call: median, "
             "min–max; GB/s = KV bytes / time; frac = of copy bandwidth; ragged = the ragged "
             "kernel on the same decode batch; peer = jax ops.gpu.paged_attention)", "",
             "| batch | context | GQA | ours ms | spread | GB/s | frac | ragged ms | spread "
             "| GB/s | frac | peer ms | spread | GB/s | frac |", "|" + "---|" * 15]
    lines += [fmt_decode_row(r) for r in report["decode"] if "kv_cache_dtype" not in r]
    quant = [r for r in report["decode"] if "kv_cache_dtype" in r]
    lines += ["", "## (b2) decode, quantized pools (our decode kernel; same batches and q as the "
              "bf16 rows; GB/s = bytes the kernel reads / time: codes + scales + zero points "
              "(fp8/int8: bf16 per-token scales; KIVI int4/int2: keys per channel, scale/zero "
              "[blocks, 1, Hkv, D] bf16, values per token in groups of 32, scale/zero "
              "[blocks, bs, Hkv, D/32] bf16, + int32 res_slot per page + the residual's null "
              "slot); bytes = of the bf16 row's; speedup = bf16 ms / ms; targets at context "
              f"{report.get('target_context', '-')})", "",
              "| batch | context | GQA | kv dtype | ms | spread | GB/s | frac | bytes vs bf16 "
              "| bf16 ms | speedup | target |", "|" + "---|" * 12]
    lines += [fmt_quant_row(r) for r in quant]
    summary = quant_target_summary(quant)
    return lines + ([""] + summary if summary else [])


def prefill_lines(report) -> list[str]:
    lines = ["", "## (c) prefill (one causal prompt; TFLOP/s = 4 · Hq · D · T · (T + 1) / 2 "
             "/ time)", "", "| kernel | tokens | ms | min–max | TFLOP/s |", "|---|---|---|---|---|"]
    return lines + table_rows(
        report["prefill"], lambda r: f"| {r['kernel']} | {r['tokens']} | {r['ms']:.3f} | "
        f"{r['min_ms']:.3f}–{r['max_ms']:.3f} | {r['tflops']:.1f} |",
        lambda r: f"| {r['kernel']} | {r['tokens']} | error: {r['error']} | | |")


def table_rows(rows, ok, error) -> list[str]:
    """One Markdown row per result: ``error(r)`` for a row that failed, else ``ok(r)``."""
    return [error(r) if "error" in r else ok(r) for r in rows]


def e2e_lines(report) -> list[str]:
    return ["", "## (f) end to end: jaxkv.LLM on random-weight models (bf16 weights; greedy, "
            "ignore_eos, random prompt ids; after a warm-up generate of the same batch, so "
            "compiles are excluded; tokens/s = output tokens / wall time of the whole run, "
            "prefill included; decode step ms = mean wall of the decode-only steps, device = the "
            "jitted step from dispatch to tokens on the host, host = the rest; host share = "
            "host / wall: median over decode steps, and over all steps' sums)", "",
            "| model | KV | batch | prompt | output | steps (decode) | tokens/s | decode step ms "
            "| device ms | host ms | host share | host share, all steps | attention | recompiles "
            "| ok |", "|" + "---|" * 15] + [fmt_e2e_row(r) for r in report["e2e"]]


def sparse_lines(report) -> list[str]:
    lines = ["", "## (b3) Quest sparse decode (bf16, GQA 4; budget = tokens attended per "
             "sequence and kv head, sinks and recent window included; MB read = the selected "
             "pages' K+V for the kernel / + the f32 key bounds of every page for the whole step; "
             "of dense = step bytes / dense bytes; kernel = sparse kernel with the selection "
             "given; step = page scores + top pages + kernel; speed-up = dense decode ms / ms; "
             "max err = kernel vs sparse_decode_reference)", "",
             "| batch | context | budget | pages read | MB read | of dense | dense ms | kernel ms "
             "| GB/s | speed-up | step ms | GB/s | speed-up | max err | ok |", "|" + "---|" * 15]
    return lines + [fmt_sparse_row(r) for r in report["sparse"]]


def kept_lines(report) -> list[str]:
    lines = ["", "## (b4) kept-blocks decode (bf16, GQA 4; tables keeping 25% of each "
              "sequence's blocks, the rest null; kept = the split-K decode kernel's kept walk, "
              "dense = the same kernel walking every logical tile of the same table; MB read = "
              "kept pages' K+V / every logical position's K+V; GB/s over those bytes; frac = of "
              "copy bandwidth; speed-up = dense ms / kept ms; max err = kept vs dense output)",
              "", "| batch | context | pages kept | MB read | kept ms | spread | GB/s | frac "
              "| dense ms | spread | GB/s | speed-up | max err | ok |", "|" + "---|" * 14]
    return lines + [fmt_kept_row(r) for r in report["kept"]]


def mla_lines(report) -> list[str]:
    lines = ["", "## (b5) MLA decode (absorbed: DeepSeek-V3's 576-wide bf16 latent, 512 + 64, "
             "all query heads of a sequence on one latent head; ours = the MLA kernel with 16 "
             "heads a program, h64 = 64; fp8 = ours over the latent as e4m3 codes and a bf16 "
             "scale per token; MB read = batch x context x 576 x 2 (fp8: x 578), the latent "
             "read once; GB/s over those bytes; frac = of copy bandwidth; max err = batch 1 vs "
             "mla_attention_reference over the same pool)", "",
             "| batch | context | heads | MB read (bf16 / fp8) | ours ms | spread | GB/s | frac "
             "| h64 ms | spread | GB/s | frac | fp8 ms | spread | GB/s | frac "
             "| max err (bf16 / fp8) | ok |", "|" + "---|" * 18]
    return lines + [fmt_mla_row(r) for r in report["mla"]]


def weights_lines(report) -> list[str]:
    lines = ["", "## (g) quantized weights (issue 51: quantized_matmul, bf16 "
              "activations; bf16 = XLA's product with the dequantized weight; GB/s over the "
              "stored bytes / the bf16 weight's; frac = of copy bandwidth; speed-up = bf16 ms / "
              "kept ms; max err = kept vs float32 dequantize-then-dot)",
              "", "| weight | type | batch | MB read | kept ms | spread | GB/s | frac | bf16 ms "
              "| spread | GB/s | speed-up | max err | ok |", "|" + "---|" * 14]
    return lines + [fmt_weight_row(r) for r in report["weights"]]


def offload_lines(report) -> list[str]:
    lines = ["", "## (e) host KV offload (16-token all-layer block units; targets on H200: "
              ">= 40 GB/s D2H, >= 45 GB/s H2D)", "",
              "| path | blocks | MiB per block | D2H GB/s | H2D GB/s |", "|---|---|---|---|---|"]
    return lines + table_rows(
        report["offload"], lambda r: f"| {r['path']} | {r['blocks']} | "
        f"{r['block_bytes'] / 2**20:.2f} | {r['d2h_gbps']:.1f} | {r['h2d_gbps']:.1f} |",
        lambda r: f"| {r['path']} | | | {r['error']} | |")


def sweep_lines(report) -> list[str]:
    lines = ["", "## (d) decode config sweep", "",
              "| batch | context | config | splits | ms | GB/s | frac |", "|" + "---|" * 7]
    for r in report["sweep"]:
        head = f"| {r['batch']} | {r['context']} | {r['config']} | {r['num_splits']} "
        lines.append(head + (f"| error: {r['error']} | | |" if "error" in r else
                             f"| {r['ms']:.4f} | {r['gbps']:.0f} | {r['frac_copy']:.2f} |"))
    return lines


def executable_lines(report) -> list[str]:
    """How the executables were got: archives used or not (why), compiled vs loaded counts and
    seconds, and the sampled executables compiled and loaded both."""
    a = report["artifacts"]
    summary = a.get("summary", {})
    lines = ["", "## executables (compiled, or loaded from an archive)", ""]
    lines += [f"* archive {n}" for n in a["archives"]] or ["* no archive given: every "
                                                           "executable compiled"]
    for how in ("compile", "load", "compile+load", "error"):
        if how in summary:
            s = summary[how]
            lines.append(f"* {how}: {s['count']} executables ({s['ahead']} got ahead), lower "
                         f"{s['lower_s']:.1f} s, compile {s['compile_s']:.1f} s, load "
                         f"{s['load_s']:.1f} s (summed over threads); the run waited "
                         f"{s['wait_s']:.1f} s for them")
    if summary.get("inline", {}).get("count"):
        lines.append(f"* {summary['inline']['count']} compiled by the run itself, not ahead "
                     f"({summary['inline']['seconds']:.1f} s)")
    if "ahead" in report:
        lines.append(f"* every executable got by {report['ahead']['done_at_s']:.0f} s; the run "
                     f"waited {report['ahead']['waited_s']:.1f} s for that before (f)")
    if "saved_s_estimate" in summary:
        lines.append(f"* loading saved ~{summary['saved_s_estimate']:.0f} s (loaded count x "
                     "(mean compile - mean load) of the sampled ones)")
    if "load_error" in summary:
        lines.append(f"* a load failed, nothing more was loaded: {summary['load_error']}")
    if a.get("saved"):
        lines.append(f"* this run's compiled executables archived in {a['saved']}")
    if summary.get("sampled"):
        lines += ["", "| sampled executable | section | compile s | load s | same output |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['name'][:80]} | {r['section']} | {r['compile_s']:.2f} | "
                  f"{r['load_s']:.3f} | {r['same_output']} |" for r in summary["sampled"]]
    return lines


SECTION_LINES = dict(correctness=correctness_lines, decode=decode_lines, prefill=prefill_lines,
                     e2e=e2e_lines, sparse=sparse_lines, kept=kept_lines, mla=mla_lines,
                     weights=weights_lines, offload=offload_lines, sweep=sweep_lines)


def markdown(report) -> str:
    """The report's tables, of the sections that ran, in the order they ran."""
    lines = run_lines(report)
    for name in report["sections_s"]:
        lines += SECTION_LINES[name](report) if name in SECTION_LINES else []
    lines += executable_lines(report)
    if report["errors"]:
        lines += ["", "## errors", ""] + [f"* {e}" for e in report["errors"]]
    return "\n".join(lines) + "\n"
