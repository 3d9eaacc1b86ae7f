"""A step's outputs cross processes every step (to an ingress over Serve): they pickle as their class and
fields in order, and come back equal."""

from __future__ import annotations

import pickle
import pickletools

from ray import cloudpickle

from workers.outputs import CompletionOutput, Logprob, RequestOutput


def test_outputs_pickle_as_their_fields_and_come_back_equal():
    lp = {5: Logprob(-0.5, 1, "t"), 9: Logprob(-1.25, 2, None)}
    out = RequestOutput("r", "p", [1, 2], [CompletionOutput(0, "t", [5], -0.5, [lp], "stop", 7),
                                            CompletionOutput(1, "", [], None, None, None, None)],
                        True, 3, {"arrival_time": 1.0}, [None, {2: Logprob(-1.0, 2, "x")}])
    for data in [pickle.dumps(out, protocol) for protocol in (2, 4, 5)] + [cloudpickle.dumps(out)]:
        back = pickle.loads(data)
        assert back == out and type(back.outputs[0].logprobs[0][9]) is Logprob
        # built by calling the class with the fields, no slots state set after (BUILD) as copyreg would
        assert not any(op.name == "BUILD" for op, _, _ in pickletools.genops(data))
    for obj in (out, out.outputs[0], lp[5]):
        cls, fields = obj.__reduce__()
        assert cls is type(obj) and fields == tuple(getattr(obj, name) for name in cls.__slots__)
