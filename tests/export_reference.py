"""An independent reference for what reads a checkpoint through the lm-evaluation-harness
bridge or generates from it: the checkpoint's plain Hugging Face export run through the
plain-PyTorch forward of ``llama_reference`` (with a sharing region), tokenised by the documented
rule. A tied export (``tie_word_embeddings``) has no ``lm_head.weight`` in its file; its head is
the embedding, as transformers ties it."""

import json
from pathlib import Path

import torch

from llama_reference import forward, weights_from_hf_style


class Reference:
    """log-probabilities from a plain export's weights (``hf-export`` without ``--region``) through ``llama_reference.forward``."""

    def __init__(self, exported: Path, max_length: int):
        from safetensors.torch import load_file

        from epas_megatron.data.tokenizer import load_tokenizer

        config = json.loads((exported / "config.json").read_text())
        self.layers, self.heads, self.groups = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
        self.eps = config["rms_norm_eps"]
        self.base = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
        state = load_file(exported / "model.safetensors")
        if config.get("tie_word_embeddings"):
            assert "lm_head.weight" not in state, "a tied export saves the matrix once"
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        self.weights = weights_from_hf_style(state, self.layers)
        self.tokenizer = load_tokenizer(exported / "tokenizer.model")
        self.max_length = max_length

    def logprobs(self, tokens, region):
        """[len(tokens), vocab] log-probabilities of the next token after each position."""
        sharing = tuple(range(self.layers - region, self.layers))
        with torch.no_grad():
            logits = forward(self.weights, torch.tensor([tokens]), self.layers, self.heads, self.groups,
                             sharing=sharing, eps=self.eps, base=self.base)
        return torch.log_softmax(logits[0, :, :self.tokenizer.vocab_size].double(), dim=-1)

    def encode(self, context, continuation):
        """The documented rule: trailing whitespace moves to the continuation; the continuation is
        what follows encode(context) in encode(context + continuation); empty context = EOS."""
        tok = self.tokenizer
        stripped = context.rstrip()
        continuation, context = context[len(stripped):] + continuation, stripped
        if not context:
            return [tok.eos], tok.tokenize(continuation)
        ctx = tok.tokenize(context)
        return ctx, tok.tokenize(context + continuation)[len(ctx):]

    def loglikelihood(self, context, continuation, region):
        ctx, cont = self.encode(context, continuation)
        tokens = (ctx + cont)[-(self.max_length + 1):]
        logprobs = self.logprobs(tokens[:-1], region)[-len(cont):]
        return float(sum(logprobs[i, t] for i, t in enumerate(cont))), all(int(logprobs[i].argmax()) == t for i, t in enumerate(cont))

    def rolling(self, text, region):
        """Disjoint windows of self.max_length predictions, each with as much context as fits."""
        x = [self.tokenizer.eos] + self.tokenizer.tokenize(text)  # x[j + 1] is the text's token j
        total, start = 0.0, 0
        while start < len(x) - 1:
            end = min(start + self.max_length, len(x) - 1)  # predict x[start + 1 : end + 1]
            logprobs = self.logprobs(x[max(0, end - self.max_length):end], region)[-(end - start):]
            total += float(sum(logprobs[i, t] for i, t in enumerate(x[start + 1:end + 1])))
            start = end
        return total

    def greedy(self, tokens, region, new_tokens):
        """``new_tokens`` greedy continuations of ``tokens``, one full forward per step."""
        tokens = list(tokens)
        for _ in range(new_tokens):
            tokens.append(int(self.logprobs(tokens, region)[-1].argmax()))
        return tokens[-new_tokens:]
