"""Test helper shared by the trainer tests: the train state a run left in its workdir."""

import jax

from xformers_jax import train


def final_state(config, workdir):
    """``(state, data_state)`` of the latest checkpoint under ``workdir`` for ``config``,
    restored into a template of the config's model (and the task's carried memory, if any)."""
    task = train.make_task(config.data, config.seed)
    model = train.build_model(config.model, task, jax.random.PRNGKey(1))
    carry = None if task.spec.carry is None else task.spec.carry(model, config.batch_size,
                                                                 False)
    schedule = train.make_schedule("constant", learning_rate=1.0, warmup_steps=1, total_steps=1)
    template = train.create_train_state(
        model, train.make_optimizer(schedule, weight_decay=0.1, grad_clip_norm=1.0),
        jax.random.PRNGKey(2), carry=carry)
    checkpointer = train.Checkpointer(workdir)
    try:
        return checkpointer.restore_latest(template)
    finally:
        checkpointer.close()
