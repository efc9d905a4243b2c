"""Speculative decoding: a cheap proposer guesses k tokens, the target scores 1 + k in one step.

config.py     SpeculativeConfig (vLLM's --speculative-config keys), validated
ngram.py      the prompt-lookup proposer (incremental n-gram index per request)
rejection.py  verification: greedy prefix match, or the rejection sampler
stats.py      proposed / accepted counts, by position
"""
