"""Train a SentencePiece BPE tokenizer (byte fallback, deterministic) on .txt / .jsonl files.

    python tools/train_tokenizer.py --input data/*.jsonl --output-prefix data/tok32k --vocab-size 32000
    python tools/preprocess_data.py --input data/*.jsonl --output-prefix data/corpus --tokenizer-model data/tok32k.model
"""

import argparse
import sys

from epas_megatron.data.tokenizer import train_sentencepiece
from epas_megatron.errors import ConfigError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help=".txt or .jsonl files")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--json-key", default="text", help="field of .jsonl records holding the text")
    parser.add_argument("--txt-documents", default="paragraphs", choices=["paragraphs", "files"],
                        help="a .txt document is a blank-line separated paragraph block, or the whole file")
    args = parser.parse_args(argv)
    try:
        path = train_sentencepiece(args.input, args.output_prefix, args.vocab_size,
                                   json_key=args.json_key, txt_documents=args.txt_documents)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return ConfigError.exit_code
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
