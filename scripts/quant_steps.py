"""Steps to the compress bench's language-model target when each step's gradient goes through
k-bit block quantization with both of ``gradsync.compress.quantized``'s error feedbacks, in one
process: no exchange, so what it shows is the optimiser's cost of the roundings, not the link's
(docs/benchmarks.md, "int4: half int8's bytes").

    python3 scripts/quant_steps.py BITS      # 8 (int8), 4 (int4), 3, 2; 32: no quantization

Each step computes the gradients of SIZE (4) ranks on their own batches (the bench's task,
``gradsync.bench.compress_tasks``, the same seeds), and does what ``Int8``/``Int4`` do with
them: each rank adds its residual and quantizes per block of 1,024 (scale ``max|x| / QMAX``,
QMAX = 2^(BITS-1) - 1) keeping what it lost; the average of what they sent, plus the owner's
residual, is quantized again, keeping what that lost; AdamW applies the result. Prints the
validation loss (rank 0's share of the validation set) every 8 steps until it is at most 2.4
or 400 steps have run.
"""

import sys

import torch

from lag_steps import MAX_STEPS, SIZE, reached, setup  # scripts/lag_steps.py

BLOCK = 1024


def quantized(x: torch.Tensor, qmax: float) -> torch.Tensor:
    """``x`` rounded per block of BLOCK elements to multiples of ``max|block| / qmax``."""
    n = x.numel()
    rows = torch.cat([x, x.new_zeros(-n % BLOCK)]).view(-1, BLOCK)
    scales = rows.abs().amax(1, keepdim=True) / qmax
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return ((rows / scales).round().clamp(-qmax, qmax) * scales).view(-1)[:n]


def main() -> None:
    bits = int(sys.argv[1])
    qmax = None if bits >= 32 else float(2 ** (bits - 1) - 1)
    torch.set_num_threads(1)
    tasks, model, opt, gens, params = setup()
    numel = sum(p.numel() for p in params)
    residuals = [torch.zeros(numel) for _ in range(SIZE)]
    owner = torch.zeros(numel)
    for step in range(1, MAX_STEPS + 1):
        average = torch.zeros(numel)
        for rank in range(SIZE):
            model.zero_grad()
            x, y = tasks[rank].batch(gens[rank])
            tasks[rank].loss(model, x, y).backward()
            g = torch.cat([p.grad.reshape(-1) for p in params])
            if qmax is None:
                average += g / SIZE
                continue
            v = g + residuals[rank]
            sent = quantized(v, qmax)
            residuals[rank] = v - sent
            average += sent / SIZE
        if qmax is not None:
            w = average + owner
            average = quantized(w, qmax)
            owner = w - average
        offset = 0
        for p in params:
            p.grad = average[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        opt.step()
        if reached(step, tasks, model):
            break


if __name__ == "__main__":
    main()
