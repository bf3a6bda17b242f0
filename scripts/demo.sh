#!/usr/bin/env bash
# The seed's admission lab, end to end, through the real CLI.
# Usage: bash scripts/demo.sh [path/to/kvledger]      (`make demo` passes .venv/bin/kvledger)
set -euo pipefail

KV="${1:-kvledger}"
if ! command -v "$KV" >/dev/null 2>&1; then
    echo "demo: cannot run '$KV'; run 'make demo' (it creates .venv) or pass the kvledger path" >&2
    exit 1
fi
# The JSON summaries are read with the Python that sits beside the CLI (the venv's), else python3.
PY="$(dirname "$(command -v "$KV")")/python"
[ -x "$PY" ] || PY=python3

# The seed's synthetic decoder: 32 layers x 8 KV heads x head dim 128, BF16 K and V, 16-token blocks.
SEED=(--layers 32 --kv-heads 8 --head-dim 128 --kv-dtype bf16 --block-size 16)
# Eight requests with one common 2,048-token prompt, admitted into a 512 MiB pool (step 1 shows the geometry).
LAB=("${SEED[@]}" --pool 512MiB --requests 8 --prompt 2048 --shared-prefix 2048 --no-geometry)

if [ -t 1 ]; then BOLD=$'\033[1m' PLAIN=$'\033[0m'; else BOLD='' PLAIN=''; fi
step() { printf '\n%s== %s%s\n' "$BOLD" "$*" "$PLAIN"; }
say() { printf '%s\n' "$@"; }

# One line from `kvledger admit --json`.
summary() {
    "$KV" admit "${LAB[@]}" "$@" --json | "$PY" -c '
import json, sys
print("  max-new {max_new}, {groups} group(s): {blocks_per_request} blocks/request; admitted {admitted} "
      "of {requests} using {admitted_blocks} of {pool_blocks} blocks; {free_blocks_after} left to promise"
      .format(**json.load(sys.stdin)))'
}

step "1. Size the pool and one request: kvledger plan ... --pool 512MiB --prompt 2048 --max-new 257"
"$KV" plan "${SEED[@]}" --pool 512MiB --prompt 2048 --max-new 257
say "Page rounding: 2,048 + 257 = 2,305 tokens is 144.06 blocks of 16, so a request is charged 145."
say "Its last block holds a single token but is a whole 2 MiB page all the same."
say "Without sharing, two requests need 290 blocks: only one fits in 256."

step "2. Eight requests, one trust group, shared prefix: kvledger admit ... --groups 1"
"$KV" admit "${LAB[@]}" --max-new 257 --groups 1
say "Shared blocks are charged once: the first request allocates the 128 prompt blocks, the others"
say "take a reference on them and only need their own 17 private blocks (the promised output)."
say "Seven requests cost 128 + 7 x 17 = 247 blocks; the eighth needs 17 more and only 9 are left,"
say "so it is 'not_now' (it would fit an emptier pool). All eight together would need 264."

step "3. The same eight requests, each in its own trust group: kvledger admit ... --groups 8"
"$KV" admit "${LAB[@]}" --max-new 257 --groups 8
say "Trust groups force separate copies: the token ids are identical, but the trust group is part"
say "of every block's identity, so no request may read another group's prefix. Each needs its own"
say "145 blocks (1,160 for all eight), and after the first one only 111 can be promised."

step "4. A shorter output allowance: kvledger admit ... --max-new 129 --groups 1"
"$KV" admit "${LAB[@]}" --max-new 129 --groups 1
say "Output reservation is per request: 2,048 + 129 tokens is 137 blocks, 9 of them private, so all"
say "eight fit: 128 + 8 x 9 = 200 blocks, 56 left. The shared prefix did not change; the promise did."
say "The boundary is sharp, because outputs are charged in whole blocks:"
summary --max-new 256 --groups 1
say "One token less per request than step 2 (256 instead of 257) saves a whole private block each:"
say "2,304 tokens is exactly 144 blocks, and 128 + 8 x 16 = 256 fills the pool exactly."
say "Isolated requests barely gain from a shorter output:"
summary --max-new 129 --groups 8
say "Two isolated copies would need 2 x 137 = 274 blocks; a second trust group only gets in when the"
say "whole request fits in 128 blocks, i.e. with no output allowance at all."

step "5. A real model on a real GPU: kvledger plan --model llama-3.1-8b --gpu h100-80gb ..."
"$KV" plan --model llama-3.1-8b --gpu h100-80gb --prompt 2048 --max-new 257
say "The pool is what vLLM would leave on an H100: 0.9 x the 79.18 GiB the driver reports, less the weights,"
say "the profile run's peak activation (its sampler warm-up over 1,024 sequences dominates) and non-torch"
say "memory, rounded down to whole 2 MiB blocks (Llama 3.1 8B has the seed's KV geometry). vLLM logs"
say "51.38 GiB for this model and GPU; --explain shows each term's formula and source."
say "'fit at once' assumes no sharing and the full 257-token reservation for each request."

step "6. Real generation: the bundled SmolLM2-135M-Instruct through the ledger and the scheduler"
say "Shared system prompt, n = 3 sampling, and a pool too small for everyone to grow at once, so the"
say "scheduler preempts (recompute) and resumes; the first run converts the model once (a minute or two)."
"$PY" "$(dirname "$0")/demo_runtime.py"

step "7. Try it yourself in the browser: kvledger lab"
say "The same lab as an interactive page on the real ledger: predict, reveal a block map of the pool,"
say "change one control, write your admission decision and check yourself. Start it with"
say "  $KV lab --open        (serves http://127.0.0.1:8765/ until Ctrl-C; --port 0 picks a free port)"
