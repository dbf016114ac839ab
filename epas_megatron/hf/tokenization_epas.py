"""``EpasTokenizer``: the project's SentencePiece tokenizer behind ``AutoTokenizer``.

It gives the ids ``SentencePieceProcessor.encode`` gives for the whole text, as the training
data and ``epas-generate`` saw them: the model's own normalizer (identity for models trained
here, which keeps repeated whitespace), no added BOS or EOS, and ``decode`` is the processor's
(lossless). Pretraining separated documents by EOS and never emitted BOS, so the tokenizer has
no BOS token: tools that start an empty context with BOS (lm-evaluation-harness) fall back to
EOS, as ``epas-eval --lm-eval-tasks`` does.

This file ships inside every exported model directory: it imports only ``transformers`` (whose
SentencePiece backend needs the ``sentencepiece`` package).
"""

from __future__ import annotations

from transformers.tokenization_utils_sentencepiece import SentencePieceBackend


class EpasTokenizer(SentencePieceBackend):
    """SentencePiece ids of the whole text, no special tokens added (see the module notes)."""

    vocab_files_names = {"vocab_file": "tokenizer.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file=None, unk_token="<unk>", bos_token=None, eos_token="</s>", pad_token=None, **kwargs):
        kwargs["legacy"] = True  # the processor's own encoding, dummy prefix as the model was trained
        super().__init__(vocab_file=vocab_file, unk_token=unk_token, bos_token=bos_token, eos_token=eos_token,
                         pad_token=pad_token, **kwargs)

    def _tokenize(self, text, **kwargs):
        return self.sp_model.encode(text, out_type=str)

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        return list(token_ids_0) + list(token_ids_1 or [])

    def convert_tokens_to_string(self, tokens):
        return self.sp_model.decode_pieces(list(tokens))

    def _decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None, **kwargs):
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        if skip_special_tokens:
            special = set(self.all_special_ids)
            ids = [i for i in ids if i not in special]
        return self.sp_model.decode([int(i) for i in ids])


__all__ = ["EpasTokenizer"]
