"""Megatron-Core's ``Float16Module`` with the pipeline ends read off the wrapped chunk.

``Float16Module`` casts the inputs of the first pipeline stage to half precision and the outputs
of the last stage back to fp32, and finds those stages from the process groups: the first rank's
first virtual stage, the last rank's last one -- Megatron's own placement. Under V placement the
last stage (output layer and loss) is rank 0's second chunk, and rank ``p-1``'s second chunk is a
middle stage whose output goes on to the next in half precision; asking the groups would cast the
wrong chunks. The wrapped :class:`~epas_megatron.model.gpt.EpasGPTModel` knows what it is
(``pre_process``: it embeds, ``post_process``: it has the head), for every placement.
"""

from __future__ import annotations

from megatron.core.transformer.module import Float16Module, float16_to_fp32, fp32_to_float16


class StageFloat16Module(Float16Module):
    """``Float16Module`` whose first and last stage are the wrapped chunk's ``pre_process`` and
    ``post_process`` (see the module doc)."""

    def forward(self, *inputs, fp32_output=True, **kwargs):
        if self.module.pre_process:
            inputs = fp32_to_float16(inputs, self.float16_convertor)
        outputs = self.module(*inputs, **kwargs)
        if self.module.post_process and fp32_output:
            outputs = float16_to_fp32(outputs)
        return outputs
