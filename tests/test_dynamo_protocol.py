"""The Dynamo backend's Dynamo-free parts (jaxkv/entrypoints/dynamo/protocol.py, model_card.py):
Dynamo's request dicts as SamplingParams, engine outputs as delta chunks whose tokens equal the
offline engine's greedy output, and the tokenizer files Dynamo registers re-read by the
``tokenizers`` library. Needs no Dynamo (tests/test_dynamo.py drives the real thing)."""

import asyncio
import json

import pytest
import tokenizers

from jaxkv import AsyncLLM, SamplingParams
from jaxkv.entrypoints.dynamo import protocol
from jaxkv.entrypoints.dynamo.model_card import hf_class, is_hf_dir, write_card
from tiny_models import TINY_ENGINE

# a request as Dynamo 1.6.1's preprocessor sends it (captured from a live frontend)
REQUEST = {
    "token_ids": [504, 3575, 282, 4649, 314], "model": "SmolLM2-135M-Instruct",
    "stop_conditions": {"max_tokens": 12, "stop": ["\n"], "stop_token_ids": None,
                        "stop_token_ids_visible": None, "stop_token_ids_hidden": [2],
                        "min_tokens": None, "ignore_eos": None, "max_thinking_tokens": None},
    "sampling_options": {"n": None, "best_of": None, "presence_penalty": None,
                         "frequency_penalty": 0.1, "repetition_penalty": None,
                         "temperature": 0.5, "top_p": 0.9, "top_k": None, "min_p": None,
                         "use_beam_search": None, "length_penalty": None, "seed": 3,
                         "include_stop_str_in_output": None, "guided_decoding": None},
    "output_options": {"logprobs": 2, "prompt_logprobs": None, "skip_special_tokens": None,
                       "formatted_prompt": None, "return_tokens_as_token_ids": None},
    "eos_token_ids": [2], "annotations": [], "routing": {"dp_rank": 0},
}


def with_(request, group, **values):
    return {**request, group: {**request[group], **values}}


def test_a_dynamo_request_becomes_sampling_params():
    p = protocol.sampling_params(REQUEST, max_model_len=2048)
    assert (p.temperature, p.top_p, p.frequency_penalty, p.seed) == (0.5, 0.9, 0.1, 3)
    assert (p.max_tokens, p.stop_token_ids, p.logprobs, p.stop) == (12, (2,), 2, ())
    assert (p.top_k, p.min_p, p.repetition_penalty, p.ignore_eos) == (-1, 0.0, 1.0, False)


def test_max_tokens_defaults_to_what_the_context_leaves():
    request = with_(REQUEST, "stop_conditions", max_tokens=None)
    assert protocol.sampling_params(request, max_model_len=100).max_tokens == 95


def test_stop_ids_of_every_kind_join_once():
    request = with_(REQUEST, "stop_conditions", stop_token_ids=[7, 2],
                    stop_token_ids_visible=[9], ignore_eos=True, min_tokens=3)
    p = protocol.sampling_params(request, 2048)
    assert (p.stop_token_ids, p.ignore_eos, p.min_tokens) == ((7, 2, 9), True, 3)


def test_guided_decoding_becomes_structured_outputs():
    request = with_(REQUEST, "sampling_options", guided_decoding={"json": {"type": "object"}})
    spec = protocol.sampling_params(request, 2048).structured_outputs
    assert json.loads(spec.json) == {"type": "object"}
    request = with_(REQUEST, "sampling_options", guided_decoding={"choice": ["yes", "no"]})
    assert protocol.sampling_params(request, 2048).structured_outputs.choice == ("yes", "no")


@pytest.mark.parametrize("group,key,value", [
    ("sampling_options", "n", 2), ("sampling_options", "best_of", 3),
    ("sampling_options", "use_beam_search", True),
    ("stop_conditions", "max_thinking_tokens", 100),
    ("output_options", "prompt_logprobs", 1),
])
def test_what_jaxkv_cannot_honour_is_refused_by_name(group, key, value):
    with pytest.raises(protocol.UnsupportedRequest, match=key):
        protocol.sampling_params(with_(REQUEST, group, **{key: value}), 2048)


def test_neutral_values_of_unsupported_options_pass():
    request = with_(REQUEST, "sampling_options", n=1, best_of=1, use_beam_search=False)
    assert protocol.sampling_params(request, 2048).n == 1


def test_a_bad_value_names_the_field():
    with pytest.raises(ValueError, match="temperature"):
        protocol.sampling_params(with_(REQUEST, "sampling_options", temperature=-1.0), 2048)


@pytest.fixture(scope="module")
def engine(tiny):
    llm = AsyncLLM(str(tiny[0]), **TINY_ENGINE)
    yield llm
    llm.shutdown()


def run(engine, request, max_model_len=256, stop_after=None):
    """The chunks of one request through ``ChunkWriter`` (aborted after ``stop_after``)."""
    async def go():
        params = protocol.sampling_params(request, max_model_len)
        writer, chunks = protocol.ChunkWriter(engine.tokenizer, params.logprobs or 0), []
        stream = await engine.add_request({"prompt_token_ids": request["token_ids"]}, params)
        async for out in stream:
            chunk = writer.chunk(out)
            if chunk is not None:
                chunks.append(chunk)
            if stop_after is not None and len(chunks) == stop_after:
                stream.abort()
                chunks.append(protocol.cancelled_chunk(len(request["token_ids"]), writer.sent))
                break
        return chunks
    return asyncio.run(go())


def greedy_request(tokens, max_tokens, **output_options):
    return {"token_ids": tokens, "sampling_options": {"temperature": 0.0},
            "stop_conditions": {"max_tokens": max_tokens, "ignore_eos": True},
            "output_options": output_options}


def test_chunks_carry_the_greedy_tokens_once_each(engine, tiny_llm):
    tokens = tiny_llm.tokenizer.encode("It is a truth universally acknowledged")
    want = tiny_llm.generate([{"prompt_token_ids": tokens}], SamplingParams(
        temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    chunks = run(engine, greedy_request(tokens, 9))
    assert [t for c in chunks for t in c["token_ids"]] == want
    assert all(c["index"] == 0 for c in chunks) and len(chunks) > 1
    assert [c.get("finish_reason") for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    usage = chunks[-1]["completion_usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        len(tokens), 9, len(tokens) + 9)
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0


def test_logprobs_align_with_the_tokens(engine, tiny_llm):
    tokens = tiny_llm.tokenizer.encode("Emma Woodhouse, handsome")
    chunks = run(engine, greedy_request(tokens, 5, logprobs=3))
    for c in chunks:
        assert len(c["log_probs"]) == len(c["top_logprobs"]) == len(c["token_ids"])
        for token, lp, top in zip(c["token_ids"], c["log_probs"], c["top_logprobs"]):
            assert [e["rank"] for e in top] == [1, 2, 3]
            assert top[0]["token_id"] == token and top[0]["logprob"] == pytest.approx(lp)
            assert bytes(top[0]["bytes"]) == tiny_llm.tokenizer.token_bytes(token)


def test_a_cancelled_request_ends_with_a_cancelled_chunk_and_frees_its_blocks(engine, tiny_llm):
    tokens = tiny_llm.tokenizer.encode("She was the youngest of the two daughters")
    chunks = run(engine, greedy_request(tokens, 200), stop_after=2)
    assert chunks[-1]["finish_reason"] == "cancelled"
    assert chunks[-1]["completion_usage"]["completion_tokens"] == sum(
        len(c["token_ids"]) for c in chunks)
    for _ in range(100):   # the abort lands before the device thread's next step
        if engine.stats_now()["num_requests_running"] == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert engine.stats_now()["num_requests_running"] == 0


def test_an_engine_abort_maps_to_cancelled():
    assert protocol.FINISH_REASONS["abort"] == "cancelled"


def test_the_written_card_reencodes_like_the_engine(tiny_llm, tmp_path):
    core = tiny_llm.engine
    out = write_card(core.tokenizer, core.model_config, 256, tmp_path / "card")
    assert is_hf_dir(out)
    backend = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "It is a truth universally acknowledged, 1234 <|im_start|>user\nhi<|im_end|>"
    assert backend.encode(text).ids == core.tokenizer.encode(text)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == core.tokenizer.chat_template
    model = json.loads((out / "config.json").read_text())
    assert model["architectures"] == ["LlamaForCausalLM"] and model["model_type"] == "llama"
    assert model["max_position_embeddings"] == 256
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == list(
        core.tokenizer.eos_token_ids)


def test_hf_class_names():
    assert hf_class("qwen3_moe") == "Qwen3MoeForCausalLM"
    assert hf_class("gpt_oss") == "GptOssForCausalLM"
