"""Build the FAISS index that environments/local_search_service.py serves.

    python environments/build_search_index.py --corpus_path stub/data/search/corpus.jsonl \\
        --index_path runs/search/stub.index [--model_name PATH] [--faiss_type Flat]

Row i of the index is row i of the corpus, so serve it with the same corpus file and model. A
`<index_path>.meta.json` next to the index records the model, dimension and document count.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling service module

from local_search_service import Encoder, add_model_args, build_index, load_corpus  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Embed a JSONL corpus and write a FAISS index.")
    add_model_args(p)
    p.add_argument("--faiss_type", default="Flat",
                   help="faiss.index_factory string: Flat (exact), HNSW32, IVF1024,Flat, ...")
    p.add_argument("--batch_size", type=int, default=64)
    args = p.parse_args(argv)

    import faiss

    start = time.perf_counter()
    docs = load_corpus(args.corpus_path)
    encoder = Encoder(args.model_name, args.device, normalize=not args.no_normalize,
                      passage_prefix=args.passage_prefix, batch_size=args.batch_size)
    index = build_index(encoder, docs, args.faiss_type)
    os.makedirs(os.path.dirname(os.path.abspath(args.index_path)), exist_ok=True)
    tmp = args.index_path + ".tmp"
    faiss.write_index(index, tmp)
    os.replace(tmp, args.index_path)  # never leave a half-written index under the real name
    meta = {"model_name": encoder.model_name, "dim": encoder.dim, "documents": len(docs),
            "corpus_path": os.path.abspath(args.corpus_path), "faiss_type": args.faiss_type,
            "normalized": not args.no_normalize}
    with open(args.index_path + ".meta.json", "w") as f:
        json.dump(meta, f, indent=1)
    print(f"indexed {len(docs)} documents (dim {encoder.dim}) into {args.index_path} "
          f"in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
