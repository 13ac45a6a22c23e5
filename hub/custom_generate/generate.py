"""hf_hybrid_spec as a Hub `custom_generate` repository: exact speculative decoding for hybrid models.

    model.generate(**inputs, custom_generate="<org>/hf-hybrid-spec", trust_remote_code=True,
                   assistant_config={"drafter": "suffix"})

Everything `generate` takes keeps working; `assistant_model=`, `prompt_lookup_num_tokens=` and `assistant_config=`
choose the drafter, as after `hf_hybrid_spec.enable(model)`. The loop itself is the installed `hf_hybrid_spec`
package (requirements.txt); this file only hands the call over.
"""

from hf_hybrid_spec.generate import hub_generate


def generate(*args, model, **kwargs):
    """transformers calls this with `model=` and the arguments of `generate` (a model repository's `custom_generate/`
    passes the inputs positionally)."""
    return hub_generate(*args, model=model, **kwargs)
