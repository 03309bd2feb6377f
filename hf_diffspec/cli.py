"""Command line: `hf-diffspec demo | bench | profile | data | train | eval | push | convert | export`."""

import argparse
import json
import logging
import sys
from dataclasses import dataclass, field, fields

import torch

from .bench import PEER_METHODS, PROMPT_LOOKUP_TOKENS, SPECULATIVE_METHODS
from .machine import fast_bf16

DEFAULT_TARGET = "smollm2-135m-instruct"
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
DRAFTER_HELP = "checkpoint dir, or 'random' (default: the shipped drafter)"


def target_options(dtype: str = "bf16") -> argparse.ArgumentParser:
    """--target, --dtype (default `dtype`) and --device: the options of every subcommand that loads a target, as
    `add_parser(..., parents=[target_options()])`."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--target", default=DEFAULT_TARGET, help="built-in target name, model folder or Hub id")
    options.add_argument("--dtype", default=dtype, choices=["auto", *sorted(DTYPES)],
                         help="target dtype (auto: bf16 where it is native, else fp32)")
    options.add_argument("--device", default=None, help="device of the target, e.g. cuda (default: cpu)")
    return options


def target_dtype(args) -> torch.dtype:
    """`--dtype` as a torch dtype; auto: bf16 where it is native on `--device`, else fp32."""
    if args.dtype == "auto":
        return torch.bfloat16 if fast_bf16(args.device) else torch.float32
    return DTYPES[args.dtype]


def load_target_of(args, device=None):
    """(model, tokenizer) of `--target` in `--dtype` on `device` (default: `--device`)."""
    from . import load_target

    return load_target(args.target, dtype=target_dtype(args), device=device or args.device)


def comma_separated(text: str, kind=str, error: str | None = None) -> list:
    """The items of a comma-separated option, as `kind`. `error`: what the option takes, the message to exit with
    when an item is not a `kind` or there is none."""
    try:
        values = [kind(item.strip()) for item in text.split(",") if item.strip()]
    except ValueError:
        values = []
    if not values and error:
        raise SystemExit(f"{error}, got {text!r}")
    return values


def add_demo_parser(sub) -> None:
    """`hf-diffspec demo`."""
    demo = sub.add_parser("demo", parents=[target_options()],
                          help="plain vs speculative generate on one prompt, default target and drafter")
    demo.add_argument("--drafter", default=None, help=DRAFTER_HELP)
    demo.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
    demo.add_argument("--max-new-tokens", type=int, default=96)
    demo.add_argument("--runs", type=int, default=3,
                      help="timed runs of each (after a warm-up), interleaved; the medians are reported")
    demo.set_defaults(func=cmd_demo)


def cmd_demo(args) -> None:
    from . import load_target
    from .demo import run_demo
    from .drafters import load_drafter

    target, tok = load_target_of(args)
    # exactness is checked in float32: on a second copy when the timed runs use another dtype
    target32 = target if target.dtype == torch.float32 else load_target(args.target, dtype=torch.float32,
                                                                         device=args.device)[0]
    try:
        drafter = load_drafter(args.drafter, target, args.target)
        drafter32 = drafter if target32 is target else load_drafter(args.drafter, target32, args.target)
    except FileNotFoundError as error:
        raise SystemExit(str(error)) from None
    result = run_demo(target, tok, drafter, args.prompt, args.max_new_tokens, runs=args.runs,
                      float32_models=(target32, drafter32))
    print(result.report())
    if not result.check.identical:
        raise SystemExit(1)


def add_bench_parser(sub) -> None:
    """`hf-diffspec bench`."""
    bench = sub.add_parser("bench", parents=[target_options()], help="tau, tokens/s and speedup per method and domain")
    bench.add_argument("--drafter", default=None, help=DRAFTER_HELP)
    bench.add_argument("--methods", default="ar,dflash",
                       help=f"ar and any of {', '.join(SPECULATIVE_METHODS)}; peers: {', '.join(PEER_METHODS)}")
    bench.add_argument("--assistant-model", default=None,
                       help="ar-assistant: the smaller model (name or path; default: the target's built-in sibling)")
    bench.add_argument("--pld-tokens", type=int, default=PROMPT_LOOKUP_TOKENS,
                       help="pld and tree-lookup: prompt-lookup drafts per step (prompt_lookup_num_tokens)")
    bench.add_argument("--oracle-taus", default=None,
                       help="loop efficiency instead of --methods: an oracle drafter at these tau, e.g. 2,4,8")
    bench.add_argument("--oracle-drafts", type=int, default=None,
                       help="oracle: drafts verified per step (default 2 x tau - 1)")
    bench.add_argument("--vp-drafter", default=None, help="VP drafter for d2sd (default: the shipped one)")
    bench.add_argument("--branches", type=int, default=4, help="D²SD: K prefix lengths re-drafted")
    bench.add_argument("--tree-budget", type=int, default=16, help="D²SD: most tree nodes verified per step")
    bench.add_argument("--tree-depth", type=int, default=8, help="D²SD: deepest level of the tree")
    bench.add_argument("--branch-length", type=int, default=4, help="D²SD: tokens per branch from its branch point")
    bench.add_argument("--domains", default="code,math,chat")
    bench.add_argument("--prompts", type=int, default=5, help="prompts per domain")
    bench.add_argument("--prompts-file", default=None, help='JSONL: {"prompt": ..., "domain": ...} per line')
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--context-tokens", type=int, default=None,
                       help="put each prompt after this many tokens of reference material (the other built-in "
                            "prompts): a long-context run, e.g. 4000 or 8000")
    bench.add_argument("--batch-sizes", default="1", help="comma-separated rows decoded together, e.g. 1,4,16,64")
    bench.add_argument("--rounds", type=int, default=None,
                       help="decode every batch this many times per method, interleaved (default: enough rounds for "
                            "3 timed calls per method and batch size; at 16-64 rows a few prompts make one batch)")
    bench.add_argument("--dflash-length", type=int, default=None,
                       help="drafts verified per step by `dflash` (default: the drafter's num_draft_tokens)")
    bench.add_argument("--seed", type=int, default=0,
                       help="draws the prompts (0: the first --prompts of each domain; any other seed: a reproducible random sample) and seeds sampling")
    bench.add_argument("--do-sample", action="store_true",
                       help="sample instead of greedy decoding, every method alike (with the three settings below)")
    bench.add_argument("--temperature", type=float, default=None, help="with --do-sample (Qwen3 ships 0.6)")
    bench.add_argument("--top-k", type=int, default=None, help="with --do-sample (Qwen3 ships 20)")
    bench.add_argument("--top-p", type=float, default=None, help="with --do-sample (Qwen3 ships 0.95)")
    bench.add_argument("--json", default=None, help="write results as JSON here")
    bench.add_argument("--plot", default=None,
                       help="write a PNG here: throughput vs batch size, or speedup per domain at one batch size")
    bench.set_defaults(func=cmd_bench)


def cmd_bench(args) -> None:
    from .bench import (
        build_method_drafters, markdown_table, oracle_efficiency, oracle_markdown_table, oracle_methods, plot,
        run_benchmark, summarize, write_json,
    )
    from .drafters import shipped_drafter
    from .machine import machine_description, machine_markdown
    from .prompts import load_prompts, load_prompts_file, with_context
    from .runtime.control_cost import VerifyCost
    from .runtime.control_profiles import measure_verify_cost, verify_cost_for

    batch_sizes = comma_separated(args.batch_sizes, int, "--batch-sizes takes comma-separated integers")
    taus = []
    if args.oracle_taus:
        taus = comma_separated(args.oracle_taus, float, "--oracle-taus takes comma-separated numbers")
    if args.rounds is not None and args.rounds < 1:
        raise SystemExit(f"--rounds takes a positive number of rounds, got {args.rounds}")
    sampling = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p") if getattr(args, k) is not None}
    if sampling and not args.do_sample:
        raise SystemExit(f"--{next(iter(sampling)).replace('_', '-')} applies to sampling; add --do-sample")
    sampling = sampling if args.do_sample else None
    torch.manual_seed(args.seed)
    target, tok = load_target_of(args)
    verify_cost_for(target)  # the profile every call uses (measured now the first time), recorded with the machine
    machine = machine_description(target)
    print(machine_markdown(machine) + "\n")
    methods = [m for m in comma_separated(args.methods) if m != "ar"]
    try:
        if taus:
            drafters = oracle_methods(target, taus, drafts=args.oracle_drafts, seed=args.seed)
        else:
            drafters = build_method_drafters(
                methods, target, args.target, drafter=args.drafter, vp_drafter=args.vp_drafter,
                dflash_length=args.dflash_length, num_branches=args.branches, tree_budget=args.tree_budget,
                max_depth=args.tree_depth, branch_length=args.branch_length, assistant_model=args.assistant_model,
                prompt_lookup_tokens=args.pld_tokens, tokenizer=tok)
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(str(error)) from None
    if args.prompts_file:
        prompts = load_prompts_file(args.prompts_file, tokenizer=tok)
    else:
        prompts = load_prompts(comma_separated(args.domains), n_per_domain=args.prompts, tokenizer=tok,
                               seed=args.seed)
    if args.context_tokens:
        context = getattr(target.config.get_text_config(), "max_position_embeddings", None)
        if context is not None and args.context_tokens + args.max_new_tokens > context:
            raise SystemExit(f"--context-tokens {args.context_tokens} + --max-new-tokens {args.max_new_tokens} "
                             f"exceed the target's context of {context} tokens; ask for fewer")
        prompts = with_context(prompts, args.context_tokens, tok)
    rows = []
    for batch_size in batch_sizes:
        results = run_benchmark(target, tok, drafters, prompts, args.max_new_tokens, batch_size=batch_size,
                                rounds=args.rounds, sampling=sampling)
        rows += summarize(results)
    print(markdown_table(rows))
    extra = {}
    if taus:
        # the prediction needs the verify cost as this run sees it: measured now, 5 repeats (the cached quick profile
        # is for choosing drafts, and a few ms of noise there would read as loop overhead here)
        verify_cost = VerifyCost(measure_verify_cost(target, sizes=(1, 2, 4, 8, 16, 32), batches=tuple(batch_sizes)))
        extra["oracle"] = oracle_efficiency(rows, drafters, verify_cost)
        print("\nLoop efficiency: an oracle drafter (the target's own greedy continuation, corrupted to the oracle "
              "tau) through our loop; decode = times without the prefill (the same forward in both); predicted = "
              "achieved tau x T_verify(rows, 1) / T_verify(rows, n), measured after the run; efficiency = decode vs "
              "ar / predicted\n")
        print(oracle_markdown_table(extra["oracle"]))
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config["drafter"] = args.drafter or str(shipped_drafter(args.target))
    if args.json:
        write_json(args.json, rows, config, machine, **extra)
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


def add_data_parser(sub) -> None:
    """`hf-diffspec data relabel | generate | features`."""
    loads_target = target_options()
    data = sub.add_parser("data", help="build drafter training data")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    for name, helptext in [("relabel", "real ShareGPT exchanges; the target labels them at training time"),
                           ("generate", "the target's own greedy answers to ShareGPT prompts")]:
        p = data_sub.add_parser(name, parents=[target_options()], help=helptext)
        p.add_argument("--source", default="sharegpt", help="'sharegpt', or (generate) a JSONL prompts file")
        p.add_argument("--out", required=True)
        p.add_argument("--num-samples", type=int, required=True)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--skip", type=int, default=0, help="skip the first N prompts of the seeded order")
        p.set_defaults(func=cmd_data)
        if name == "relabel":
            p.add_argument("--max-length", type=int, default=1024)
        else:
            p.add_argument("--max-new-tokens", type=int, default=256)
            p.add_argument("--batch-size", type=int, default=16)

    features = data_sub.add_parser(
        "features", parents=[target_options()],
        help="cache the target's features and argmax for data directories, for `train ... --cached-features`")
    features.add_argument("data", nargs="+", metavar="DIR", help="data directories written by `hf-diffspec data`")
    features.add_argument("--drafter", default=None,
                          help="the --init drafter training will start from (its feature layers; default: a new "
                               "drafter's for this target)")
    features.add_argument("--features-dtype", default="bf16", choices=["bf16", "fp32"],
                          help="stored precision (bf16: half the disk; fp32: exactly the live step's features)")
    features.add_argument("--batch-size", type=int, default=8)
    features.set_defaults(func=cmd_data)


def cmd_data(args) -> None:
    from . import load_target
    from .trainers.data import write_generated_data, write_relabel_data

    if args.data_command == "features":
        cmd_data_features(args)
        return
    if args.data_command == "relabel":
        if args.source != "sharegpt":
            raise SystemExit("data relabel reads ShareGPT (--source sharegpt); prompt files are for data generate")
        _, tok = load_target(args.target, dtype=target_dtype(args))  # its tokenizer only: --device is not used
        n = write_relabel_data(tok, args.target, args.out, args.num_samples, max_length=args.max_length,
                               seed=args.seed, skip=args.skip)
    else:
        from accelerate import PartialState

        from .prompts import load_prompts_file

        # under torchrun / accelerate launch, each process answers its share of the prompts on its own device
        state = PartialState(cpu=args.device in (None, "cpu"))
        target, tok = load_target_of(args, device=state.device if state.num_processes > 1 else None)
        prompts = None if args.source == "sharegpt" else load_prompts_file(args.source)
        n = write_generated_data(target, tok, args.target, args.out, args.num_samples,
                                 max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                                 skip=args.skip, prompts=prompts)
    print(f"{n} samples in {args.out}")


def cmd_data_features(args) -> None:
    from accelerate import PartialState

    from . import DiffusionDrafter
    from .trainers.feature_cache import CACHE_DTYPES, FEATURES_DIR, write_target_features

    state = PartialState(cpu=args.device in (None, "cpu"))
    target, _ = load_target_of(args, device=state.device if state.num_processes > 1 else None)
    # the layers the drafter to be trained reads: --drafter's, else a new drafter's for this target
    drafter = (DiffusionDrafter.from_pretrained(args.drafter, target=target) if args.drafter
               else DiffusionDrafter.from_target(target, num_hidden_layers=1))
    for data_dir in args.data:
        written = write_target_features(target, drafter, data_dir, dtype=CACHE_DTYPES[args.features_dtype],
                                        batch_size=args.batch_size)
        if state.is_main_process:
            print(f"{data_dir}/{FEATURES_DIR}: {written} shards written by this run")


def add_train_parser(sub) -> None:
    """`hf-diffspec train kd | vp | opd | length-head`: each one's options are its configuration's fields
    (`HfArgumentParser`)."""
    from transformers import HfArgumentParser

    from .trainers.configs import (
        DrafterTrainingArguments,
        LengthHeadConfig,
        OnPolicyDistillationConfig,
        VariablePrefixConfig,
    )

    train_commands = {
        "kd": (DrafterTrainingArguments, "block-diffusion distillation of a first drafter (DFlash recipe)"),
        "vp": (VariablePrefixConfig, "a D²SD variable-prefix drafter (prefix prior beta^l), usually --init FIRST"),
        "opd": (OnPolicyDistillationConfig, "AdaFlash on-policy rounds with the reverse-KL loss, from --init DRAFTER"),
        "length-head": (LengthHeadConfig, "the acceptance (length) head of --init DRAFTER, the drafter frozen"),
    }
    train = sub.add_parser("train", help="train a drafter")
    train_sub = train.add_subparsers(dest="train_command", required=True, parser_class=HfArgumentParser)
    for kind, (config_class, helptext) in train_commands.items():
        inputs = OnPolicyPromptArguments if kind == "opd" else TrainDataArguments
        trainp = train_sub.add_parser(kind, parents=[target_options(dtype="auto")], help=helptext,
                                      description=config_class.__doc__, dataclass_types=[inputs, config_class])
        trainp.set_defaults(func=cmd_train, config_class=config_class)


@dataclass
class TrainDataArguments:
    """The data `hf-diffspec train kd | vp | length-head` trains on."""

    data: list[str] = field(metadata={"help": "One or more data directories (written by `hf-diffspec data`)."})


@dataclass
class OnPolicyPromptArguments:
    """The prompts `hf-diffspec train opd` decodes in its rounds."""

    prompts_file: str | None = field(
        default=None, metadata={"help": "JSONL prompts (default: ShareGPT, evaluation sets removed)."}
    )
    skip: int = field(default=0, metadata={"help": "Skip the first N ShareGPT prompts of the seeded order."})


def cmd_train(args) -> None:
    from .trainers.pipeline import on_policy_prompts, run_opd, train_drafter

    try:
        config = args.config_class(**{f.name: getattr(args, f.name) for f in fields(args.config_class) if f.init})
    except ValueError as error:
        raise SystemExit(str(error)) from None
    # under torchrun / accelerate launch, each process's target on that process's training device
    target, tok = load_target_of(args, device=config.device if config.world_size > 1 else None)
    command = "hf-diffspec " + " ".join(sys.argv[1:])
    if args.train_command == "opd":
        prompts = on_policy_prompts(args.prompts_file, seed=config.seed, skip=args.skip)
        print(f"on-policy drafter saved to {run_opd(target, tok, args.target, prompts, config, command=command)}")
    else:
        print(f"drafter saved to {train_drafter(target, tok, args.target, args.data, config, command=command)}")


def add_eval_parser(sub) -> None:
    """`hf-diffspec eval acceptance`."""
    evaluate = sub.add_parser("eval", help="drafter quality without decoding")
    eval_sub = evaluate.add_subparsers(dest="eval_command", required=True)
    acceptance = eval_sub.add_parser(
        "acceptance", parents=[target_options()],
        help="offline acceptance length: the drafter at every anchor of the target's own sequences")
    acceptance.add_argument("--drafter", default=None, help=DRAFTER_HELP)
    acceptance.add_argument("--data", nargs="+", required=True, metavar="DIR",
                            help="held-out data directories of sequences the target wrote itself (greedy)")
    acceptance.add_argument("--max-sequences", type=int, default=None, help="read only the first N sequences")
    acceptance.add_argument("--json", default=None, help="write the report (per domain, per slot, per step) here")
    acceptance.add_argument("--against", default=None, metavar="REPORT.json",
                            help="another drafter's --json report on the same data: print the difference in tau with "
                                 "its paired standard error")
    acceptance.set_defaults(func=cmd_eval)


def cmd_eval(args) -> None:
    from .drafters import load_drafter
    from .runtime.files import atomic_write
    from .trainers.data import DrafterDataset
    from .trainers.offline_acceptance import measuring_trainer, offline_acceptance, paired_tau_difference

    base = None
    if args.against:  # read before measuring: a wrong path fails at once
        try:
            with open(args.against) as f:
                base = json.load(f)
        except (OSError, ValueError) as error:
            raise SystemExit(f"--against {args.against}: {error}") from None
        if "sequence_tau_sums" not in base:
            raise SystemExit(f"--against {args.against}: a report without per-sequence sums (written before paired "
                             "comparisons existed): measure that drafter again with --json")
    target, tok = load_target_of(args)
    try:
        drafter = load_drafter(args.drafter, target, args.target, length_head=False)
        dataset = DrafterDataset(args.data, tokenizer=tok)
        report = offline_acceptance(measuring_trainer(drafter, target), drafter, dataset, args.max_sequences)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(str(error)) from None
    print("| domain | sequences | blocks | tau (± s.e.) | decode tau | reach of slots 1-4 |\n|---|---|---|---|---|---|")
    for name, row in [*report["per_domain"].items(), ("all", report)]:
        reach = " / ".join(f"{r:.3f}" for r in row["reach"][:4])
        print(f"| {name} | {row['sequences']} | {row['blocks']} | {row['tau']:.4f} ± {row['tau_se']:.4f} | "
              f"{row['decode_tau']:.4f} | {reach} |")
    if report["unjudged_blocks"]:
        print(f"{report['unjudged_blocks']} blocks stopped where the text is not this target's own greedy choice "
              "(data written in another precision or by another target)")
    if args.against:
        try:
            difference, se = paired_tau_difference(report, base)
        except ValueError as error:
            raise SystemExit(f"--against {args.against}: {error}") from None
        print(f"tau - tau of {base.get('config', {}).get('drafter') or args.against}: {difference:+.4f} ± {se:.4f} "
              f"(paired over the same {len(report['sequence_blocks'])} sequences and {report['blocks']} blocks)")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "func"}
        atomic_write(args.json, json.dumps({"config": config, **report}, indent=1))
        print(f"wrote {args.json}")


def add_push_parser(sub) -> None:
    """`hf-diffspec push`."""
    push = sub.add_parser("push", help="upload a drafter folder to the Hugging Face Hub")
    push.add_argument("folder")
    push.add_argument("--repo-id", required=True)
    push.add_argument("--private", action="store_true")
    push.add_argument("--token", default=None, help="default: the token huggingface_hub finds (HF_TOKEN, login)")
    push.add_argument("--revision", default=None)
    push.add_argument("--dry-run", action="store_true", help="check the folder and list the files, upload nothing")
    push.set_defaults(func=cmd_push)


def cmd_push(args) -> None:
    import tempfile

    from .hub import push, stage_for_upload

    if args.dry_run:
        with tempfile.TemporaryDirectory() as staging:
            files = stage_for_upload(args.folder, staging)
        print(f"would upload {len(files)} files from {args.folder} to {args.repo_id}:")
        print("\n".join(f"  {name}" for name in files))
        return
    print(push(args.folder, args.repo_id, private=args.private, token=args.token, revision=args.revision))


def add_convert_parser(sub) -> None:
    """`hf-diffspec convert`."""
    convert = sub.add_parser("convert", help="z-lab or transformers-native DFlash checkpoint -> DiffusionDrafter; "
                                             "or a DiffusionDrafter -> one drafting over a reduced vocabulary")
    convert.add_argument("folder", help="a checkpoint folder; with --from, also a Hub repository id (owner/name)")
    convert.add_argument("--from", dest="source", default=None, choices=["zlab", "hf-native"],
                         help="layout of a published DFlash checkpoint to save as ours (DiffusionDrafter."
                              "from_pretrained also reads it directly)")
    convert.add_argument("--out", required=True)
    convert.add_argument("--reduce-vocab", type=int, default=None, metavar="N",
                         help="draft over only the N most frequent response tokens (special tokens always kept)")
    convert.add_argument("--data", nargs="+", default=[], metavar="DIR",
                         help="--reduce-vocab: drafter data directories whose response tokens are counted")
    convert.add_argument("--sharegpt-responses", type=int, default=0, metavar="N",
                         help="--reduce-vocab: also count the answers of N ShareGPT exchanges (eval prompts excluded)")
    convert.add_argument("--target", default=DEFAULT_TARGET,
                         help="--reduce-vocab: the drafter's target (tokenizer, special tokens, vocabulary)")
    convert.set_defaults(func=cmd_convert)


def cmd_convert(args) -> None:
    if (args.source is None) == (args.reduce_vocab is None):
        raise SystemExit("convert takes either --from (an external DFlash checkpoint) or --reduce-vocab N (one of our "
                         "drafters); to do both, run convert twice")
    if args.source is not None:
        from .formats import convert_to_drafter

        print(f"converted to {convert_to_drafter(args.folder, args.out, args.source)}")
        return
    from . import load_target
    from .formats import reduce_vocabulary
    from .trainers.draft_vocabulary import count_response_tokens, special_token_ids, top_tokens

    if not args.data and not args.sharegpt_responses:
        raise SystemExit("--reduce-vocab counts response tokens: pass --data DIR [DIR ...] and/or "
                         "--sharegpt-responses N")
    target, tok = load_target(args.target)
    eos = target.generation_config.eos_token_id
    keep = special_token_ids(tok) + (eos if isinstance(eos, list) else [eos] if eos is not None else [])
    try:
        counts = count_response_tokens(args.data or None, tokenizer=tok, sharegpt_responses=args.sharegpt_responses,
                                       vocab_size=target.config.get_text_config().vocab_size)
        ids = top_tokens(counts, args.reduce_vocab, keep)
        out = reduce_vocabulary(args.folder, args.out, ids)
    except (ValueError, FileNotFoundError, OSError) as error:
        raise SystemExit(str(error)) from None
    covered = float(counts[ids].sum() / counts.sum().clamp(min=1))
    print(f"draft vocabulary: {len(ids)} of {len(counts)} tokens ({len(set(keep))} special), covering "
          f"{covered:.1%} of the {int(counts.sum())} response tokens counted; saved to {out}")


def add_export_parser(sub) -> None:
    """`hf-diffspec export`."""
    export = sub.add_parser("export", help="DiffusionDrafter -> the layout vLLM / SGLang DFlash loaders read")
    export.add_argument("folder")
    export.add_argument("--format", required=True, choices=["vllm", "sglang"])
    export.add_argument("--out", required=True)
    export.add_argument("--target", help="the drafter's target (built-in name or folder): its tokenizer picks the "
                        "MASK token of a drafter that learned its own MASK vector; its head rows give "
                        "--draft-vocabulary")
    export.add_argument("--mask-token-id", default="auto",
                        help="vllm, drafters with a learned MASK vector: the target token that carries it "
                             "(mask_embedding.pt); 'auto' (default): one the target never reads")
    export.add_argument("--draft-vocabulary", action="store_true",
                        help="vllm: keep a reduced draft vocabulary (lm_head rows + d2t) instead of dropping it")
    export.set_defaults(func=cmd_export)


def cmd_export(args) -> None:
    from .formats import export_for_engine

    out, notes = export_for_engine(args.folder, args.out, args.format, target=args.target,
                                   mask_token_id=args.mask_token_id, draft_vocabulary=args.draft_vocabulary)
    for note in notes:
        print(f"note: {note}")
    print(f"exported for {args.format} to {out}")


def add_profile_parser(sub) -> None:
    """`hf-diffspec profile`."""
    profile = sub.add_parser("profile", parents=[target_options()],
                             help="measure the target's verify cost T(rows, n) once; used to size drafts and trees")
    profile.add_argument("--context-length", type=int, default=256)
    profile.add_argument("--repeats", type=int, default=5)
    profile.add_argument("--batch-sizes", default="1,2,4,8,16", help="rows per forward to measure")
    profile.add_argument("--show", action="store_true", help="list the cached profiles and stop")
    profile.add_argument("--clear", action="store_true", help="remove the cached profiles and stop")
    profile.add_argument("--graphs", action="store_true",
                         help="the profile of calls whose verify forward replays CUDA graphs (cache_implementation="
                              "'static' with HF_DIFFSPEC_CUDA_GRAPHS=1 on a CUDA device), measured through them")
    profile.add_argument("--skip-if-busy", action="store_true",
                         help="for scripts: a measurement disturbed by other processes is reported and not saved, and "
                              "the command still succeeds (generate then measures on first use)")
    profile.set_defaults(func=cmd_profile)


def cmd_profile(args) -> None:
    from .runtime.control_profiles import PROFILE_SIZES, measure_profile, save_profile

    if args.show or args.clear:
        show_or_clear_profiles(args.clear)
        return
    batches = comma_separated(args.batch_sizes, int, "--batch-sizes takes comma-separated integers")
    target, _ = load_target_of(args)
    if args.graphs:
        from .runtime.verify_graphs import graph_backend

        if graph_backend(target.device) is None:
            raise SystemExit(f"--graphs measures the verify forward replayed as CUDA graphs: that needs a CUDA device "
                             f"(the target is on {target.device}) and HF_DIFFSPEC_CUDA_GRAPHS=1. Without --graphs the "
                             "profile of eager forwards is measured.")
    measured = measure_profile(target, batches=batches, context_length=args.context_length, repeats=args.repeats,
                               graphs=args.graphs)
    costs = measured.costs
    print("ms per target forward, rows x tokens per row (cached context of "
          f"{args.context_length} tokens per row)\n")
    print("| rows \\ tokens | " + " | ".join(str(n) for n in PROFILE_SIZES) + " |")
    print("|---" * (len(PROFILE_SIZES) + 1) + "|")
    for rows, row in costs.items():
        print(f"| {rows} | " + " | ".join(f"{row[n] * 1000:.0f}" for n in PROFILE_SIZES) + " |")
    if measured.problem is not None:
        message = f"\nnot saved: the measurement {measured.problem} after {measured.attempts} attempts."
        if args.skip_if_busy:
            print(f"{message} generate() measures the profile on first use instead.")
            return
        raise SystemExit(f"{message} Stop what else runs on this machine and measure again.")
    path = save_profile(target, costs, measured.others_load, graphs=args.graphs)
    print(f"\nsaved {path}; generate() now sizes drafts and trees from it for this target/device/dtype")


def show_or_clear_profiles(clear: bool) -> None:
    """`hf-diffspec profile --show | --clear`: the cached verify-cost profiles and drafting prices, one line each, or
    remove them."""
    from .runtime.control_profiles import profile_dir, read_profile

    paths = sorted(profile_dir().glob("*.json"))
    if not paths:
        print(f"no verify-cost profiles in {profile_dir()}")
    for path in paths:
        if clear:
            path.unlink()
            print(f"removed {path}")
            continue
        if path.name.startswith("drafting-"):  # a drafter's price (`control_profiles.drafting_price_for`)
            try:
                data = json.loads(path.read_text())
                prices = ", ".join(f"{float(p):.2f} at {r} rows" for r, p in data["price"].items())
                print(f"{path.name}: a {data['method']} drafting pass costs {prices} one-token verify steps")
            except (ValueError, KeyError, TypeError, AttributeError):
                print(f"{path.name}: an unreadable drafting price (measured again on first use)")
            continue
        data = json.loads(path.read_text())
        costs, problem = read_profile(path)
        one = f"T(1 row, 1 token) = {costs[1][1] * 1000:.1f} ms" if costs and 1 in costs and 1 in costs[1] else ""
        load = data.get("others_load_cores")
        print(f"{path.name}: {data.get('model_type')} on {data.get('device')} in {data.get('dtype')}"
              + (", CUDA graphs" if data.get("graphs") else "") + ", "
              f"{data.get('threads')} threads, measured {data.get('measured_at', 'at an unknown time')}"
              + (f" with other processes at {load:.2f} cores" if load is not None else "")
              + (f"; {one}" if one else "") + (f"; {problem}" if problem else ""))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-diffspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser in (add_demo_parser, add_bench_parser, add_data_parser, add_train_parser, add_profile_parser,
                       add_eval_parser, add_push_parser, add_convert_parser, add_export_parser):
        add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
