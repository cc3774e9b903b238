"""``bench.channel_pingpong`` runs both transports between two real processes and reports each."""

from bench import channel_pingpong


def test_both_transports_complete_their_round_trips():
    for mode in ("zmq", "tcp"):
        r = channel_pingpong.run(mode, rounds=200, size=100)
        assert set(r) == {"rtt_us", "cpu_us_a", "cpu_us_b"}
        assert all(v > 0 for v in r.values()), r
