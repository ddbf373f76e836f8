"""Shrinking a failing program to a fixpoint: deleting calls, simplifying arguments and the configuration.

A program found by random search keeps calls, tokens and blocks that do not matter. Each pass below proposes
smaller candidates and keeps one only when its replay, on a fresh allocator, fails with the same
:class:`~kvfuzz.shrink.signature.Signature`. A deletion often strands a later call: one that could not be made
where it now stands (a readmission whose preemption the pool no longer forces, a decode with nothing computed, an
eviction of a block no longer released). The replay skips such a call, and the candidate is the calls it made (they
replay exactly, as saved): in a long program of preemptions and targeted evictions most candidates strand some call,
and throwing them away left delta debugging little to delete. The passes:

* delete calls: chunks of halving size down to single calls (delta debugging; with a chunk go the later calls of
  the sequences it admitted or forked), every window of two or three neighbouring calls, all the calls that name one
  sequence;
* delete every pair of distant calls naming one sequence (replays quadratic in the length);
* merge calls: a grow and the next grow of its sequence into one grow, an admit and the grow after it into an admit
  with the longer suffix (within the operations' bounds), a decode into a step;
* simplify arguments: shorter token lists (prompts, suffixes, tokens per grow), zero token values, smaller integers;
* renumber sequence ids in order of first use (``s0``, ``s1``, ...);
* simplify the configuration: fewer device blocks, fewer host blocks, a smaller block size, a smaller W (when the
  campaign chose W);
* a smaller pool (or W) and one call fewer together, where neither goes alone (a program building pool pressure).

Two things steer the candidates, from the run of the program kept last (its landmarks); neither decides what is
kept. A targeted eviction names blocks by id, and calls deleted before it change which block holds what it evicted:
each replay re-aims it at the released block that now holds the same K/V (``evict_blocks([9])`` becomes
``evict_blocks([0])`` once the admissions that pushed the content to block 9 are gone). And a program that fails
under pool pressure (every block mapped before its last call) stops failing when a deletion frees blocks: a
deleted candidate is tried in a pool as much smaller than what it maps in a roomy pool as the kept program's was,
so calls and blocks go together.

They repeat until none changes anything (the fixpoint) or the time bound runs out; the result says which. The
configuration is simplified first (a smaller pool makes every later replay cheaper). Distant pairs, merging and the
last pass run only once the others have reached their fixpoint, and the others run again after any change they
make.

A fixpoint is local: deleting calls cannot undo what a long random program happened to build first (a pool filled
by swaps where one admission would do). So a program still longer than :data:`LONG_PROGRAM` calls at its fixpoint is
shrunk again from other starting points (restarts): random programs of the campaign's swarm (its operations and
program length) under the shrunk configuration, until one fails with the same signature; the shortest fixpoint
wins. The failing programs of other signatures such a search meets are handed back, never dropped.
"""
