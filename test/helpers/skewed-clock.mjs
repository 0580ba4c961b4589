// Loaded with --import into a worker process: its wall clock is off by CLOCK_SKEW_MS (a host
// whose clock drifted, or a VM resumed from suspend). Date.now() only: timers are unaffected.
const skew = Number(process.env.CLOCK_SKEW_MS ?? 0);
const realNow = Date.now;
Date.now = () => realNow() + skew;
