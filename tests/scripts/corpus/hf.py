"""A tiny causal language model (GPT-2's architecture, random weights) trained by the
Hugging Face `Trainer`, its loss logged at every step, the model saved with
`save_pretrained`.

    python hf.py
"""

import random

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed
from transformers.utils import logging

set_seed(0)
logging.disable_progress_bar()


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(6)
        self.ids = torch.randint(0, 64, (32, 12), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


config = GPT2Config(
    vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
)
model = GPT2LMHeadModel(config)
args = TrainingArguments(
    output_dir="out",
    max_steps=6,
    per_device_train_batch_size=8,
    learning_rate=1e-3,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    disable_tqdm=True,
    use_cpu=True,
    seed=0,
)
trainer = Trainer(model=model, args=args, train_dataset=Tokens())
trainer.train()
model.save_pretrained("hf-model")
print("rng", torch.rand(2).tolist(), random.random(), np.random.rand())
