"""Speculative decoding: a cheap proposer guesses k tokens, the target scores 1 + k in one step.

config.py     SpeculativeConfig (vLLM's --speculative-config keys), validated
proposer.py   the proposer protocol (token ids and params in, proposed ids out) and its factory
ngram.py      the prompt-lookup proposer (incremental n-gram index per request)
draft.py      the draft-model proposer (a Worker of its own, shadow requests)
speculator.py how many tokens to propose each step, and the proposals' bookkeeping
rejection.py  verification: greedy prefix match, or the rejection sampler
stats.py      proposed / accepted counts, by position
"""
