"""``epas-generate``: continue prompts with a trained checkpoint at any sharing region.

    epas-generate --load runs/demo/checkpoints --prompt "The history of" --max-new-tokens 40
    epas-generate --load CKPT --region 0 --prompt-file prompts.txt --temperature 0.8 --top-p 0.9

One prompt streams its continuation to the terminal as it is generated; several prompts (one
``--prompt`` each, or one per line of ``--prompt-file``) run as one left-padded batch and print
when done. Greedy by default (``--temperature 0``). ``--json`` prints one ``GENERATE {json}``
line with the token ids, texts and throughput. Runs in one process (TP = PP = 1), on the GPU
when there is one; there each decode step replays one captured CUDA graph (``--decode-step``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from epas_megatron.errors import ConfigError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epas-generate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint root (its latest checkpoint) or an iter_NNNNNNN directory")
    p.add_argument("--region", default="max", help="sharing layers to run with (0 .. the trained region; 'max' = trained)")
    p.add_argument("--allow-untrained-regions", action="store_true", help="allow a region larger than the trained one")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-file", default=None, help="a file with one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt at most")
    p.add_argument("--greedy", action="store_true", help="the most likely token every step (same as --temperature 0)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1 = all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--decode-attention", default="auto", choices=["auto", "qk", "reuse"],
                   help="sharing layers at decode: 'qk' recomputes softmax(Q K^T) from the source's Q and cached K; "
                        "'reuse' takes the source's probabilities (exact for QK sharing, faster); auto = reuse for QK models")
    p.add_argument("--region-kernel", default="none", choices=["none", "torch", "triton"],
                   help="with reuse: P.V of the whole region's cache in one launch (torch batched matmul or the Triton kernel)")
    p.add_argument("--decode-step", default="auto", choices=["auto", "eager", "static", "cuda-graph"],
                   help="decode steps: 'cuda-graph' replays one captured fixed-shape step per token (CUDA), 'static' runs "
                        "that step without a graph, 'eager' runs each step as it comes; auto = cuda-graph on a GPU")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="model precision ('auto': bf16 on a GPU, fp32 on CPU)")
    p.add_argument("--moc-decode", default="masked", choices=["masked", "sparse"],
                   help="a Mixture-of-Channels checkpoint's decode steps: 'masked' = the MLP's dense W_down GEMM over the "
                        "masked activations (as trained); 'sparse' = read only each token's kept rows of W_down (fewer "
                        "bytes while batch x topk < 1)")
    p.add_argument("--tokenizer-model", default=None, help="SentencePiece model (default: the checkpoint's)")
    p.add_argument("--no-stream", action="store_true", help="print a single prompt's continuation only when done")
    p.add_argument("--json", action="store_true", help="also print a GENERATE {json} line")
    return p


def read_prompts(args) -> list[str]:
    """``--prompt`` values, then the non-empty lines of ``--prompt-file``."""
    prompts = list(args.prompt)
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise ConfigError(f"--prompt-file {path}: no such file")
        prompts += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ConfigError("no prompt given (--prompt TEXT or --prompt-file FILE)")
    for number, prompt in enumerate(prompts, 1):
        if not prompt.strip():
            raise ConfigError(f"prompt {number} is empty")
    return prompts


class _Streamer:
    """Prints one row's continuation as it grows (SentencePiece joins pieces, so the text is
    re-decoded and only its new suffix printed)."""

    def __init__(self, tokenizer, eos: int):
        self.tokenizer, self.eos = tokenizer, eos
        self.tokens: list[int] = []
        self.printed = ""

    def __call__(self, row: int, token: int) -> None:
        if token == self.eos:
            return
        self.tokens.append(token)
        text = self.tokenizer.detokenize(self.tokens)
        if text.startswith(self.printed):
            sys.stdout.write(text[len(self.printed):])
            sys.stdout.flush()
            self.printed = text


def main(argv: Optional[Sequence[str]] = None) -> int:
    from epas_megatron.compat.quiet import quiet_library_noise

    quiet_library_noise()
    args = _parser().parse_args(argv)
    try:
        from epas_megatron.inference.generator import Generator
        from epas_megatron.inference.sampling import SamplingParams
        from epas_megatron.runtime.accelerator import check_accelerator

        check_accelerator()

        prompts = read_prompts(args)
        if args.greedy and args.temperature:
            raise ConfigError("--greedy and --temperature > 0 contradict each other")
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        if args.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
        generator = Generator.from_checkpoint(
            args.load, args.region, allow_untrained_region=args.allow_untrained_regions,
            decode_attention=args.decode_attention, region_kernel=None if args.region_kernel == "none" else args.region_kernel,
            precision=args.precision, tokenizer_model=args.tokenizer_model, decode_step=args.decode_step,
            moc_decode=args.moc_decode)
        generator.encode(prompts)  # bad prompts fail here, before any model work is printed
        print(f"checkpoint {generator.checkpoint} | region {generator.region} of {len(generator.engine.modes)} layers "
              f"(trained {generator.trained_region}) | decode attention {generator.engine.decode_attention}",
              file=sys.stderr, flush=True)
        stream = None
        if len(prompts) == 1 and not args.no_stream:
            sys.stdout.write(prompts[0])
            stream = _Streamer(generator.tokenizer, generator.tokenizer.eos)
        started = time.perf_counter()
        results = generator.generate(prompts, max_new_tokens=args.max_new_tokens, sampling=sampling, stream=stream)
        seconds = time.perf_counter() - started
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return ConfigError.exit_code
    finally:
        from epas_megatron.runtime.distributed import destroy_distributed

        destroy_distributed()

    if stream is not None:
        sys.stdout.write("\n")
    else:
        for prompt, result in zip(prompts, results):
            print(f"{prompt}{result.text}")
    generated = sum(len(r.tokens) for r in results)
    print(f"{generated} tokens in {seconds:.2f} s ({generated / seconds:.1f} tokens/s, prefill included)", file=sys.stderr)
    if args.json:
        payload = {"checkpoint": str(generator.checkpoint), "region": generator.region, "trained_region": generator.trained_region,
                   "decode_attention": generator.engine.decode_attention, "region_kernel": generator.engine.region_kernel,
                   "moc_decode": generator.engine.moc_decode, "seconds": seconds,
                   "results": [{"prompt": p, "prompt_tokens": r.prompt_tokens, "tokens": r.tokens, "text": r.text,
                                "finish_reason": r.finish_reason} for p, r in zip(prompts, results)]}
        print("GENERATE " + json.dumps(payload), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
