"""Write ``docs/benchmarks.md`` from the latest result of every benchmark (``bench/results/*.md``,
each starting with the command that produced it), so the page shows exactly what was last run.

Run: ``.venv/bin/python bench/report.py`` after any benchmark.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TITLES = {
    "engines": "Rollout engines: transformers vs the stand-in server vs vLLM on CPU (bench/engines.py)",
    "engines_smollm2": "Rollout engines on SmolLM2-135M-Instruct: tokens/s, first token, weight and adapter push pauses (bench/engines.py --models smollm2)",
    "modes": "Execution modes: sync vs async vs fully async (bench/modes.py)",
    "modes-no-tis": "Execution modes without TIS (bench/modes.py)",
    "modes-eval-separate": "Fully async with and without evaluation beside training (bench/modes.py --eval-compare)",
    "fleet": "Rollout fleet: 1, 2, 4, 8 producers through S3 (bench/fleet.py)",
    "stream": "SampleStream vs raw fsspec (bench/stream.py)",
    "train_step": "Train step: torch vs DeepSpeed, full vs LoRA (bench/train_step.py)",
    "train_step_profile": "Where a train step goes, beside the bare-torch limit (bench/train_step.py --profile)",
    "multi_lora": "Multi-LoRA: shared rollouts vs separate runs (bench/multi_lora.py)",
    "modes_smollm2": "Modes on SmolLM2-135M-Instruct, generation-heavy (bench/modes.py --model smollm2-135m-instruct)",
    "multi_lora_smollm2": "Multi-LoRA on SmolLM2-135M-Instruct: 4 adapters over one stream vs 4 LoRA runs (bench/multi_lora.py --model smollm2-135m-instruct)",
    "train_step_profile_smollm2": "Where a SmolLM2 train step goes, beside the bare-torch limit (bench/train_step.py --profile --model smollm2-135m-instruct)",
    "resume": "Checkpoints and resumes, per mode (bench/resume.py)",
    "orchestration": "What Prefect costs a run, in CPU (bench/orchestration.py)",
    "peer_trl_async": "What costs the async modes their extra steps (bench/peer_trl.py --systems ...)",
    "peer_trl_beta2": "AdamW beta2 0.99 vs 0.999 (bench/peer_trl.py --systems sync,sync+beta2=0.999)",
    "peer_trl": "Against TRL's GRPOTrainer, the same work to the same accuracy (bench/peer_trl.py)",
    "peer_trl_smollm2": "Against TRL's GRPOTrainer on SmolLM2-135M-Instruct (bench/peer_trl.py --model smollm2-135m-instruct)",
    "real_model": "A real model: memory and disk of SmolLM2-135M-Instruct runs (bench/real_model.py)",
    "rewards": "Rewards: the math reward against math-verify alone, and each reward's time per call (bench/rewards.py)",
    "real_model-vllm": "A real model on the vLLM engine (bench/real_model.py)",
    "tinker": "The Tinker API: the cookbook's RL loop through miles tinker-serve vs miles train, concurrent clients (bench/tinker.py)",
    "tinker_smollm2": "The Tinker API on SmolLM2-135M-Instruct: the cookbook's RL loop on the arithmetic task vs miles train, seed 0 (bench/tinker.py --model smollm2-135m-instruct --parts parity --steps 12)",
    "tinker_smollm2_t0.5": "The Tinker API on SmolLM2-135M-Instruct at temperature 0.5, where the cookbook's loss and miles train's differ (bench/tinker.py --model smollm2-135m-instruct --parts parity --temperature 0.5)",
    "tinker_smollm2_seed1": "The Tinker API on SmolLM2-135M-Instruct, seed 1 (bench/tinker.py --model smollm2-135m-instruct --parts parity --steps 12 --seed 1)",
    "tinker_passes": "The Tinker service's training passes on SmolLM2: one pass, 512-token passes, each prompt once (bench/tinker_passes.py)",
    "peer_trl_smollm2_idle": "Against TRL's GRPOTrainer on SmolLM2-135M-Instruct, rerun (bench/peer_trl.py --model smollm2-135m-instruct --systems trl,sync,async)",
}


def main() -> None:
    parts = ["# Benchmarks", "",
             "The latest table of each benchmark, as `bench/results/` holds it (regenerate with",
             "`.venv/bin/python bench/report.py`). Every table was produced on the project's 2-core CPU machine by",
             "the command above it; the machine is shared and noisy, so compare rows of one table, not tables.", ""]
    results = sorted((ROOT / "bench" / "results").glob("*.md"), key=lambda p: (p.stem not in TITLES, p.stem))
    for path in results:
        parts += [f"## {TITLES.get(path.stem, path.stem)}", "", path.read_text().strip(), ""]
    (ROOT / "docs" / "benchmarks.md").write_text("\n".join(parts))


if __name__ == "__main__":
    main()
