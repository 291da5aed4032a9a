"""The step loop: many sequences decoded together over a paged KV cache. add() queues a
sequence; each step() asks the scheduler what to compute (one token for each running
sequence, then chunks of prompts, within a token budget), runs it as one forward pass,
and samples a token for every sequence whose cached tokens reached its end. Sequences join
and leave between steps (continuous batching), and a prompt whose beginning is cached
(prefix caching) computes only the rest. A sequence with a constraint (structured outputs)
samples among the tokens its grammar allows, a mask computed on the CPU while the forward
pass runs, and ends when the grammar is complete.

Every tensor-parallel rank must make the same calls in the same order: the scheduler
decides alike on every rank, and the sampled tokens are broadcast from rank 0, which alone
compiles grammars and computes their masks: with a constrained sequence's token goes what it
did to the grammar (went on, completed it, broke it), so that every rank ends it alike.

A server runs the steps on the engine's own thread (start, then wait), so that they
overlap what it does meanwhile; run() and step() work on the caller's thread too, and an
engine made with threaded=False runs start()'s function on the caller's thread as well."""

import functools
import itertools
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

import collectives
import structured
from ahead import Ahead, may_run_ahead, runs_ahead, sample_ahead
from batch import Batch
from kv_cache import BlockPool
from sampler import adjust_logits, load_race, sample, token_logprobs
from scheduler import Scheduler, Work
from sequence import GOES_ON, SamplingParams, Sequence
from speculative import Speculation
from structured import Constraint, Matcher
from tokenizer import TextStream


class Engine:
    def __init__(self, runner, tokenizer, max_seqs: int | None = None, max_batched_tokens: int = 0,
                 prefix_caching: bool = True, threaded: bool = True, speculation: Speculation | None = None,
                 async_scheduling: bool = False):
        """runner: the model and its KV cache (runner.ModelRunner). max_seqs: the most
        sequences decoded together (default: the runner's max_batch_size); max_batched_tokens:
        the most tokens one step computes (0: no limit); prefix_caching: reuse the cached blocks that a prompt starts with;
        threaded: start() runs on a thread of the engine's own (else at once, on the
        caller's: a server whose steps run in turn with its own work); speculation: proposed
        tokens verified in the steps (speculative.py), or none; async_scheduling: a step
        starts before the host has the tokens of the one before (vLLM v1's asynchronous
        scheduling: step())."""
        self.runner, self.tokenizer = runner, tokenizer
        self.device = runner.device
        self.max_seq_len = runner.max_seq_len
        self.pool = BlockPool(runner.num_blocks, runner.block_size, prefix_caching)
        self.scheduler = Scheduler(self.pool, max_seqs or runner.max_batch_size, max_batched_tokens)
        self.ids = itertools.count()
        self.speculation = speculation
        if self.device.type == "cpu":
            load_race()  # built now (once, cached across processes), not in the first sampled request
        # The model runs on a thread of the engine's own (start, wait), so that a server's
        # round trip overlaps the steps; torch captures and replays CUDA graphs per thread,
        # so compiling happens there too, and the thread works on this rank's GPU. On a
        # CPU, steps on the thread that loaded the model measured faster (one OpenMP team
        # instead of two: docs/tuning-log.md, the steps in turn on the worker's main thread).
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="engine", initializer=use_device,
                                         initargs=(self.device,)) if threaded else None
        self.pending: Future | None = None
        # grammar masks are computed here while the forward pass runs (llguidance leaves the GIL)
        self.masker = ThreadPoolExecutor(1, thread_name_prefix="masks")
        self.pace = 0.0  # seconds per step in the last run(), 0 before the first
        self.long_step = False  # the last step computed a chunk of a prompt beside tokens for others (run)
        if async_scheduling and speculation:
            raise ValueError("asynchronous scheduling cannot run with speculation: "
                             "proposals come from the host's tokens")
        self.async_scheduling = async_scheduling
        self.ahead: Ahead | None = None  # the last step's tokens, while the host does not have them

    @property
    def running(self) -> list[Sequence]:
        """The sequences not finished: waiting for blocks, prefilling or decoding."""
        return list(self.scheduler.waiting) + self.scheduler.running

    def check(self, prompt_tokens: list[int], params: SamplingParams):
        if not prompt_tokens:
            raise ValueError("the prompt is empty")
        max_gen_len = params.max_gen_len
        if max_gen_len < (0 if params.echo else 1):
            raise ValueError(f"max_gen_len must be at least 1 (0 only with echo), got {max_gen_len}")
        n = len(prompt_tokens) + max_gen_len
        if n > self.max_seq_len:
            raise ValueError(f"prompt of {len(prompt_tokens)} tokens + {max_gen_len} new tokens exceeds "
                             f"max_seq_len {self.max_seq_len}")
        if n > self.pool.num_blocks * self.pool.block_size:
            raise ValueError(f"prompt of {len(prompt_tokens)} tokens + {max_gen_len} new tokens exceeds the KV "
                             f"cache ({self.pool.num_blocks} blocks of {self.pool.block_size} tokens)")

    def add(self, prompt_tokens: list[int], params: SamplingParams) -> Sequence:
        """Queue a prompt; its prefill happens in the coming steps (with max_gen_len 0 and
        echo, the prompt is only scored)."""
        self.check(prompt_tokens, params)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.device).manual_seed(params.seed)
        seq = Sequence(list(prompt_tokens), params, next(self.ids), generator,
                       stream=TextStream(self.tokenizer, prompt_tokens if params.continue_prompt else []))
        self.prepare(seq)
        self.scheduler.add(seq)
        return seq

    def prepare(self, seq: Sequence):
        """The sampling state that the sequence's settings need."""
        p, vocab = seq.params, self.runner.vocab_size
        seq.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.tokenizer.stop_ids)
        if p.logit_bias:
            seq.bias = torch.zeros(vocab, device=self.device)
            seq.bias[list(p.logit_bias)] = torch.tensor(list(p.logit_bias.values()), device=self.device)
        if (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) != (0, 0, 1):
            seq.counts = torch.zeros(vocab, device=self.device)
            seq.seen = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            seq.seen[seq.prompt_tokens] = True
        if p.constraint is not None and collectives.tp_world()[0] == 0:
            seq.matcher = self.matcher(p.constraint)

    @functools.cached_property
    def vocabulary(self) -> structured.Vocabulary:
        """The tokenizer's tokens as llguidance sees them, with the model's vocabulary size;
        built at the first constraint (a second for 128k tokens), not for servers that get none."""
        return structured.vocabulary(self.tokenizer, self.runner.vocab_size)

    def matcher(self, constraint: Constraint) -> Matcher:
        """A new sequence's matcher for constraint; ValueError, saying why, if it does not compile."""
        return self.vocabulary.matcher(constraint)

    def release(self, seq: Sequence):
        """Forget a sequence (finished, or its request gone): its blocks go back to the pool."""
        if seq in self.scheduler.running or seq in self.scheduler.waiting:
            self.scheduler.remove(seq)

    def start(self, fn, *args):
        """fn(*args) (run(), or the runner's compile_decode) on the engine's thread, or now on
        this one (threaded=False). Until wait(), the caller touches neither the engine nor
        its sequences."""
        assert self.pending is None, "wait() for what the engine runs before starting more"
        if self.thread:
            self.pending = self.thread.submit(fn, *args)
            return
        self.pending = Future()  # done before start() returns; wait() gives its outcome
        try:
            self.pending.set_result(fn(*args))
        except Exception as e:
            self.pending.set_exception(e)

    def wait(self):
        """What the function start() began returned (None if nothing was started); its
        exception is raised here."""
        pending, self.pending = self.pending, None
        return None if pending is None else pending.result()

    def run(self, max_steps: int, seconds: float = 0.0, min_steps: int = 1) -> int:
        """Up to max_steps steps; given seconds, only as many as fit in that time at the
        pace of the last run's steps, but at least min_steps. Fewer when a step gives a
        sequence its first token or ends one (whoever waits for it hears at once) or leaves
        nothing to run. A step that computed a chunk of a prompt beside tokens for others (a
        long step) takes longer than the pace said: given seconds, the run goes on with the
        steps of its pace that fit in the time left (the streams' messages keep their
        cadence while a long prompt is prefilled); without, it ends there. The same on every
        rank: the counts are rank 0's, and the rest depends on the sequences only. Returns
        the steps taken. With asynchronous scheduling, the last step's tokens may still be on
        the device when it returns (a server's iteration of one step still overlaps the
        host's work): the next run's first step appends them, and a sequence ended by one of
        them ends then."""
        if seconds:
            max_steps = self.steps_within(seconds, min_steps, max_steps)
        begin = last = time.perf_counter()
        n = 0
        while n < max_steps:
            n += 1
            if self.step() or not self.running:
                break
            now = time.perf_counter()
            if self.long_step:
                if not seconds:
                    break
                max_steps = n + self.steps_within(seconds - (now - begin), 0, max_steps - n, pace=now - last)
            last = now
        self.pace = (time.perf_counter() - begin) / n
        return n

    def steps_within(self, seconds: float, min_steps: int, max_steps: int, pace: float | None = None) -> int:
        """How many steps of the last run's pace (or pace) fit in seconds (min_steps to
        max_steps), by rank 0's clock: each rank's own would differ, and the ranks must take
        the same steps."""
        pace = pace or self.pace
        fit = int(seconds / pace) if pace else min_steps
        steps = torch.tensor([max(min_steps, min(max_steps, fit))], device=self.device)
        if collectives.tp_world()[1] > 1:
            collectives.broadcast(steps, src=0)
        return int(steps)

    def step(self) -> bool:
        """One forward pass over this step's work, and a token for each sequence whose
        prompt or last token it finished (more where it verifies proposed tokens). True if a
        sequence got its first token or ended.

        With asynchronous scheduling, a step whose sequences allow it (runs_ahead) leaves its
        tokens on the device, where the next step reads them; the host appends them (text,
        stop strings, ends) after it has queued that next step, while the device runs it."""
        news, self.long_step = False, False
        if self.ahead and not may_run_ahead(self.scheduler, self.pool):
            news = self.catch_up()
        if self.speculation:
            self.speculation.reserve([s for s in self.scheduler.running if Scheduler.uncached(s) == 1])
        work = self.scheduler.schedule()
        if not work:
            return self.catch_up() or news
        if self.speculation:
            self.propose(work)
        batch, rows = self.batch(work)
        # a token is due for each sequence whose last pending token this step computes (not a
        # chunk of its prompt): known before the forward pass, so that its mask is computed
        # meanwhile; it comes from the row before those of its proposed tokens
        to_sample = [(w.seq, last - 1 - len(w.seq.draft)) for w, (_, last) in zip(work, rows)
                     if completes(w) and w.seq.params.max_gen_len]
        seqs, sample_rows = [s for s, _ in to_sample], [row for _, row in to_sample]
        self.long_step = bool(seqs) and not all(map(completes, work))
        deferred = self.async_scheduling and all(map(runs_ahead, seqs))
        masks = None if deferred else self.start_masks(seqs)
        logits = self.runner.forward_batch(batch)
        for w, (first, last) in zip(work, rows):
            seq = w.seq
            if seq.scores_prompt:
                self.add_prompt_logprobs(seq, logits[first:last])
            if completes(w) and seq.params.max_gen_len == 0:
                seq.finish_reason = "length"  # a prompt to score, nothing to generate
            seq.cached += w.n - len(seq.draft)  # a proposed token's entry counts once it is accepted
        previous = self.ahead  # None unless deferred (may_run_ahead)
        if deferred:
            self.ahead = sample_ahead(seqs, logits, sample_rows) if seqs else None
        else:
            self.advance(seqs, logits, sample_rows, masks)
        for w in work:
            self.after_step(w.seq)
            if not w.seq.ahead:  # else its news comes with its token
                news |= w.seq.done or len(w.seq.sampled) == 1
        return self.settle(previous) or news

    def after_step(self, seq: Sequence):
        """Its blocks as its tokens on the host now stand: those of rejected proposals go back,
        the full ones are named (prefix caching); all of them go back once it is done."""
        if seq.draft_room and not seq.done:  # the blocks of rejected tokens go back
            seq.table.trim(len(seq.prompt_tokens) + len(seq.tokens))
            seq.draft_cached = min(seq.draft_cached, seq.cached)
        seq.draft, seq.draft_room = [], 0
        known = min(seq.cached, len(seq.prompt_tokens) + len(seq.tokens))  # not a token still on the device
        if known // self.pool.block_size > len(seq.table.hashes):
            seq.table.commit(seq.prompt_tokens + seq.tokens, known)
        if seq.done:
            self.scheduler.remove(seq)

    def catch_up(self) -> bool:
        """Settle the last step that ran ahead: the host has every token then."""
        ahead, self.ahead = self.ahead, None
        return self.settle(ahead)

    def settle(self, ahead: "Ahead | None") -> bool:
        """Append the tokens of a step that ran ahead. True if one was a sequence's first or
        ended it."""
        if ahead is None:
            return False
        news, running = False, set(self.scheduler.running)
        for seq, token in zip(ahead.seqs, ahead.on_host()):
            if seq.done or seq not in running:  # it ended (or left) the step before
                continue
            seq.ahead -= 1
            seq.append(token)
            self.after_step(seq)
            news |= seq.done or len(seq.sampled) == 1
        return news

    def propose(self, work: list[Work]):
        """Proposed tokens for the decoding sequences the scheduler made room for; each work
        then computes its last token and those, as decode rows (batched, compiled, CUDA
        graphs), which stay before the prefill chunks."""
        self.speculation.propose([w.seq for w in work])
        for w in work:
            w.n += len(w.seq.draft) - w.seq.draft_room
        work.sort(key=lambda w: not (w.seq.draft or self.scheduler.is_decode(w)))

    def batch(self, work: list[Work]) -> tuple[Batch, list[tuple[int, int]]]:
        """The forward pass's Batch, and for each work the rows [first, last) of its logits:
        the last token's only, or every token's when the prompt's logprobs are wanted."""
        batch = Batch(tokens=[], positions=[], slots=[], logits_at=[])
        rows = []
        for w in work:
            seq = w.seq
            tokens = seq.tokens_between(seq.cached, seq.cached + w.n - len(seq.draft)) + seq.draft
            if seq.ahead:  # its token, sampled by the step before, is on the device
                batch.add([0], seq.cached, seq.table.blocks, self.pool.block_size, decode=True)
                batch.carry(self.ahead.index[seq], self.ahead.tokens)
            elif seq.draft:  # verifying: a decode row per token, each attending up to its own position
                for i, token in enumerate(tokens):
                    batch.add([token], seq.cached + i, seq.table.blocks, self.pool.block_size, decode=True)
            else:
                batch.add(tokens, seq.cached, seq.table.blocks, self.pool.block_size, self.scheduler.is_decode(w))
            index = len(batch.tokens) - w.n
            # a proposed token's row verifies the next one (speculative.py)
            scored = w.n if seq.scores_prompt else 1 + len(seq.draft)
            wanted = range(index + w.n - scored, index + w.n)
            rows.append((len(batch.logits_at), len(batch.logits_at) + len(wanted)))
            batch.logits_at += wanted
        if len(batch.logits_at) == len(batch.tokens):
            batch.logits_at = None  # every token's (decode steps): no selection
        return batch, rows

    def add_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor):
        """Log-probabilities (and the most probable tokens) of the prompt tokens that these
        logits (one row per token computed, from seq.cached on) predict and that have none
        yet: a preempted sequence recomputes tokens it scored before, and keeps those scores.
        Nothing predicts the first token."""
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(0.0)
            seq.prompt_top_logprobs.append([])
        start = len(seq.prompt_logprobs)  # the first token without a score
        skip = start - 1 - seq.cached  # row i predicts token seq.cached + 1 + i
        targets = seq.prompt_tokens[start:seq.cached + 1 + logits.shape[0]]
        if targets:
            chosen, top = token_logprobs(logits[skip:skip + len(targets)],
                                         torch.tensor(targets, device=logits.device), seq.params.top_logprobs)
            seq.prompt_logprobs += chosen
            seq.prompt_top_logprobs += top

    def start_masks(self, seqs: list[Sequence]) -> Future | None:
        """The masks of the constrained sequences among seqs (the ones about to sample: one
        bitmask row each), started on the masks thread. Rank 0's alone: every rank samples,
        but the tokens are rank 0's."""
        rows = [(seq.matcher, i) for i, seq in enumerate(seqs) if seq.matcher is not None]
        if not rows or collectives.tp_world()[0] != 0:
            return None
        return self.masker.submit(filled, structured.new_bitmask(len(seqs), self.runner.vocab_size), rows)

    def advance(self, seqs: list[Sequence], logits: torch.Tensor, rows: list[int], masks: Future | None = None):
        """Sample a token for each sequence from its row of logits (rank 0's choice for every
        rank), within its grammar's mask (masks: start_masks'), and append it. A sequence with
        proposed tokens (seq.draft) has a row for each after its own: while the token sampled
        is the one proposed, it stands (its cache entry with it) and the next row samples:
        each token costs a sampled row one draw, as without proposals. Drawing from p and
        keeping the proposal when the draw gives it is Leviathan et al.'s rejection sampling
        for a proposal of one token (q(draft) = 1: accepted with probability p(draft), else
        a token from p without it), exact, and with no draw of its own."""
        depth, going = 0, list(range(len(seqs)))
        accepted = [0] * len(seqs)
        bitmask = masks.result() if masks else None
        while going:
            group = [seqs[i] for i in going]
            if depth:  # the grammar has consumed the tokens accepted so far
                masks = self.start_masks(group)
                bitmask = masks.result() if masks else None
            drafts = [s.draft[depth] if depth < len(s.draft) else None for s in group]
            raw = logits[[rows[i] + depth for i in going]]
            next_tokens = sample(adjust_logits(raw, group, bitmask), group)
            grammar = grammar_verdicts(group, next_tokens)
            if collectives.tp_world()[1] > 1:
                collectives.broadcast(next_tokens if grammar is None else grammar, src=0)
                if grammar is not None:
                    next_tokens = grammar[0]
            self.append_all(group, raw, next_tokens, grammar)
            going = [i for i, draft, token in zip(going, drafts, next_tokens.tolist())
                     if draft == token and not seqs[i].done]
            for i in going:
                seqs[i].cached += 1
                accepted[i] += 1
            depth += 1
        if self.speculation:
            for seq, n in zip(seqs, accepted):
                if seq.draft:
                    self.speculation.record(seq, n)

    def append_all(self, seqs: list[Sequence], logits: torch.Tensor, tokens: torch.Tensor,
                   grammar: torch.Tensor | None = None):
        """Append each sequence's token, with its logprobs where asked for, and what it did to
        its grammar (grammar_verdicts)."""
        asked = [s.params.top_logprobs for s in seqs if s.params.logprobs]
        if asked:
            chosen, top = token_logprobs(logits, tokens, max(asked))
        verdicts = [GOES_ON] * len(seqs) if grammar is None else grammar[1].tolist()
        for i, (s, token) in enumerate(zip(seqs, tokens.tolist())):
            if s.params.logprobs:
                s.append(token, chosen[i], top[i][:s.params.top_logprobs], grammar=verdicts[i])
            else:
                s.append(token, grammar=verdicts[i])


def grammar_verdicts(seqs: list[Sequence], tokens: torch.Tensor) -> torch.Tensor | None:
    """(2, len(seqs)): the tokens, and what each did to its sequence's grammar (rank 0's
    Sequence.grammar_verdict; zeros on the other ranks, which get rank 0's); None when no
    sequence is constrained."""
    if all(s.params.constraint is None for s in seqs):
        return None
    verdicts = [s.grammar_verdict(token) for s, token in zip(seqs, tokens.tolist())]
    return torch.stack([tokens, torch.tensor(verdicts, dtype=tokens.dtype, device=tokens.device)])


def filled(bitmask: torch.Tensor, rows: list[tuple[Matcher, int]]) -> torch.Tensor:
    structured.fill_bitmasks(bitmask, rows)
    return bitmask


def completes(w: Work) -> bool:
    """Whether w computes its sequence's last pending token, after which a token is due."""
    return w.n >= Scheduler.uncached(w.seq)


def use_device(device: torch.device):
    if device.type == "cuda":  # a new thread's current device is cuda:0
        torch.cuda.set_device(device)
