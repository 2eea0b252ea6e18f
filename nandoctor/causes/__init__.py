"""Why a run went non-finite: the cause catalog (and, beside it, the rules that rank causes).

`catalog` holds each cause id's title, explanation, fix and snippets; `nandoctor lint`
and the docs read the same entries. This package init imports nothing heavy on purpose:
`lint` must not pay for torch.
"""
