"""Token selection: per-request parameters, TGIS's logit rules, the sampler, prompt logprobs."""
