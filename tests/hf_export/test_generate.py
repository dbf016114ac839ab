"""Greedy ``generate()`` of the export (remote code, its ``EpasCache``) on a left-padded batch
gives the tokens of ``epas-generate``'s generator (this framework's model and decode engine) on
the same checkpoint, at every region; text prompts go through the exported tokenizer, which gives
the ids of the checkpoint's own."""

import pytest
import torch

PROMPTS = ["Return the absolute value of", "Open the file and return a corresponding", "If the list is empty"]
NEW_TOKENS = 8


def until_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize("region", [0, 1, 2])
def test_greedy_generate_equals_epas_generate(region, checkpoint, exported, load_export, world):
    from transformers import AutoTokenizer

    from epas_megatron.hf import EpasCache
    from epas_megatron.inference.generator import Generator

    generator = Generator.from_checkpoint(checkpoint, region=region)
    tokenizer = AutoTokenizer.from_pretrained(exported, trust_remote_code=True)
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert ids == [generator.tokenizer.tokenize(p) for p in PROMPTS] and len({len(i) for i in ids}) == len(ids)
    expected = [r.tokens for r in generator.generate(ids, max_new_tokens=NEW_TOKENS)]

    tokenizer.padding_side = "left"
    inputs = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert (inputs["attention_mask"] == 0).any()  # really left-padded
    model = load_export(exported, epas_region=region).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, return_dict_in_generate=True)
    assert type(out.cache).__name__ == EpasCache.__name__ and out.cache.kinds.count("v") == region
    new = out.sequences[:, inputs["input_ids"].shape[1]:].tolist()
    assert [until_eos(row, tokenizer.eos_token_id) for row in new] == expected
