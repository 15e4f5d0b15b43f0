"""Check a model directory written by gguf_to_hf: a greedy chat answer, and plain vLLM
against transformers on the same prompt (no UniPrefill: no additional_config).

    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=1 OMP_NUM_THREADS=1 \
        taskset -c 1 python benchmarks/accuracy/check_converted.py MODEL_DIR [--json OUT]

Prints, and writes with --json: transformers' and vLLM's greedy answers to QUESTION
through the chat template, and for PROMPT the max abs difference of the two engines'
next-token log-probabilities over the whole vocabulary and over transformers' top 20,
and both top-5 lists. Both engines run in --dtype; transformers first, then it is freed
before vLLM starts, so one model is resident at a time.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

QUESTION = "What is the capital of France?"
PROMPT = "The Eiffel Tower is located in the city of"


def transformers_side(model_dir: str, dtype: str, question: str, prompt: str, new_tokens: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    chat_ids = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    chat_ids = list(getattr(chat_ids, "input_ids", chat_ids))  # BatchEncoding in newer releases
    prompt_ids = tok(prompt).input_ids
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([chat_ids]), max_new_tokens=new_tokens, do_sample=False, top_p=None
        )
        answer_ids = out[0, len(chat_ids) :].tolist()
        logits = model(torch.tensor([prompt_ids])).logits[0, -1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
    return {
        "chat_ids": chat_ids,
        "prompt_ids": prompt_ids,
        "answer_ids": answer_ids,
        "answer": tok.decode(answer_ids, skip_special_tokens=True),
        "logprobs": logprobs,
        "decode": tok.decode,
    }


def vllm_side(model_dir: str, dtype: str, chat_ids, prompt_ids, new_tokens: int, max_len: int):
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(
        model_dir,
        dtype=dtype,
        max_model_len=max_len,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_logprobs=-1,
        seed=0,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    full = SamplingParams(temperature=0.0, max_tokens=1, logprobs=-1)
    chat, scored = llm.generate(
        [{"prompt_token_ids": chat_ids}, {"prompt_token_ids": prompt_ids}],
        [greedy, full],
        use_tqdm=False,
    )
    vocab = llm.llm_engine.model_config.get_vocab_size()
    logprobs = torch.full((vocab,), float("-inf"))
    for token_id, lp in scored.outputs[0].logprobs[0].items():
        logprobs[token_id] = lp.logprob
    return {"answer_ids": list(chat.outputs[0].token_ids), "logprobs": logprobs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--question", default=QUESTION)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    t0 = time.time()
    hf = transformers_side(args.model_dir, args.dtype, args.question, args.prompt, args.new_tokens)
    gc.collect()
    t1 = time.time()
    vl = vllm_side(
        args.model_dir, args.dtype, hf["chat_ids"], hf["prompt_ids"], args.new_tokens,
        args.max_model_len,
    )  # fmt: skip
    t2 = time.time()

    decode = hf["decode"]
    hf_lp, vl_lp = hf["logprobs"], vl["logprobs"][: len(hf["logprobs"])]
    hf_top20 = hf_lp.topk(20).indices
    hf_top5, vl_top5 = hf_lp.topk(5).indices.tolist(), vl_lp.topk(5).indices.tolist()
    result = {
        "model_dir": args.model_dir,
        "dtype": args.dtype,
        "question": args.question,
        "transformers_answer": hf["answer"],
        "vllm_answer": decode(vl["answer_ids"], skip_special_tokens=True),
        "same_answer_tokens": hf["answer_ids"] == vl["answer_ids"],
        "prompt": args.prompt,
        "prompt_tokens": len(hf["prompt_ids"]),
        "max_abs_logprob_diff_vocab": float((hf_lp - vl_lp).abs().max()),
        "max_abs_logprob_diff_top20": float((hf_lp - vl_lp)[hf_top20].abs().max()),
        "transformers_top5": [[decode([t]), round(float(hf_lp[t]), 4)] for t in hf_top5],
        "vllm_top5": [[decode([t]), round(float(vl_lp[t]), 4)] for t in vl_top5],
        "same_top5_order": hf_top5 == vl_top5,
        "same_top5_set": set(hf_top5) == set(vl_top5),
        "seconds": {"transformers": round(t1 - t0, 1), "vllm": round(t2 - t1, 1)},
    }
    text = json.dumps(result, indent=2, ensure_ascii=False)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
