"""Stream a speculating text-generation pipeline.

    python examples/pipeline.py [--max-new-tokens 48]

transformers.pipeline("text-generation") calls model.generate; after specgraph.attach it
speculates (here with the EAGLE-3 head that ships for SmolLM2-135M-Instruct) and a
TextIteratorStreamer receives the text as tokens are accepted, several per verify step. The script
checks that the streamed text, the pipeline's result and the pipeline's result without specgraph
are the same.
"""
import argparse
from threading import Thread

import transformers

import specgraph
from specgraph.models import load_default_draft, load_gguf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    model, tokenizer = load_gguf()
    messages = [{"role": "user", "content": "Give three tips for a first marathon."}]
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    without = pipe(messages, **settings)[0]["generated_text"][-1]["content"]

    specgraph.attach(model, load_default_draft(), tree=specgraph.DynamicTree(3, 4, 8),
                     max_cache_len=128 + args.max_new_tokens)
    streamer = transformers.TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = {}
    worker = Thread(target=lambda: result.update(out=pipe(messages, streamer=streamer, **settings)))
    worker.start()
    pieces = []
    for piece in streamer:  # arrives while the pipeline is still generating
        print(piece, end="", flush=True)
        pieces.append(piece)
    worker.join()
    specgraph.detach(model)

    answer = result["out"][0]["generated_text"][-1]["content"]
    same = "".join(pieces).strip() == answer.strip() == without.strip()
    print(f"\n\nstreamed {len(pieces)} pieces; streamed text, pipeline result and the pipeline without "
          f"specgraph agree: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
