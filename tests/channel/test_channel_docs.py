"""The README's trust model says who can reach what on the data channel, and names every
limit an operator can set (the ``channel_*`` settings), so a reader can judge the exposure."""
from __future__ import annotations

import os
import re

from raymq.actors.channel import DATA_METHODS
from raymq.actors.config import ClusterConfig
from tests.helpers import ROOT

README = os.path.join(ROOT, "README.md")


def trust_model() -> str:
    text = open(README).read()
    found = re.search(r"^### Trust model\n(.*?)(?=^#{1,3} )", text, re.S | re.M)
    assert found, "README has no '### Trust model' subsection"
    return found.group(1)


def test_the_trust_model_says_who_reaches_what():
    section = trust_model()
    for words in ("token", "RAY_USE_TLS", "RAY_TLS_CA_CERT", "ShardActor.endpoint",
                  "restricted unpickler", "transport=\"ray\"", "raymq status", "HMAC"):
        assert words in section, words
    for method in DATA_METHODS:
        assert f"`{method}`" in section, method


def test_the_trust_model_names_every_channel_limit_with_its_default():
    section = trust_model()
    settings = [(name, default) for name, default, _doc in ClusterConfig.describe()
                if name.startswith("channel_")]
    assert len(settings) == 10
    for name, default in settings:
        assert f"`{name}`" in section, name
