"""The router's choice: a prompt goes where its prefix went unless that instance is much busier;
otherwise to the least loaded, ties taken in turn (per set of instances)."""

from __future__ import annotations

from ridge.router.policy import Instance, PrefixAffinity, prefix_chunks


def _instances(role: str, n: int) -> list[Instance]:
    return [Instance(f"http://{role}{i}", role, healthy=True) for i in range(n)]


def test_ties_go_round_for_each_set_of_instances():
    policy = PrefixAffinity()
    prefill, decode = _instances("p", 2), _instances("d", 2)
    picks = []
    for i in range(8):  # a request picks a prefill, then a decode instance
        policy.choose(prefill, f"prompt {i}")
        picks.append(policy.choose(decode, f"prompt {i}").url)
    assert picks.count("http://d0") == picks.count("http://d1") == 4


def test_a_prefix_goes_back_where_it_went_unless_that_instance_is_much_busier():
    policy = PrefixAffinity(cache_threshold=0.5, balance_threshold=4, chunk_chars=16)
    a, b = _instances("r", 2)
    system = "You are a helpful assistant. " * 8
    first = policy.choose([a, b], system + "Question one?")
    other = b if first is a else a
    first.in_flight = 3  # busier, within the balance threshold
    assert policy.choose([a, b], system + "Question two?") is first
    first.in_flight = 10  # far busier: the least loaded takes it
    assert policy.choose([a, b], system + "Question three?") is other
    assert policy.match(other, prefix_chunks(system + "Question three?", 16)) == 1.0  # recorded there now


def test_load_counts_what_the_instance_reports_waiting():
    policy = PrefixAffinity()
    a, b = _instances("r", 2)
    a.waiting = 5
    assert all(policy.choose([a, b], f"p{i}") is b for i in range(3))
