// The clouds the chaos campaign's workers call, in a process of their own, as a real cloud
// is: the campaign's own work (enqueueing thousands of operations, listening to BullMQ's
// events) then cannot delay what the clouds see, and the call log records when a request
// reached the cloud, not when a busy runner got round to reading it. Spoken to over IPC.
import { CreateosFake, type CreateosControls } from '../src/fakes/createos-fake.ts';
import { DaytonaFake, type SandboxControls } from '../src/fakes/daytona-fake.ts';
import type { FakeCall } from '../src/fakes/http-fake.ts';

export type CloudRequest =
  | { id: number; type: 'control'; cloud: 'daytona'; id2: string; controls: SandboxControls }
  | { id: number; type: 'control'; cloud: 'createos'; id2: string; controls: CreateosControls }
  | { id: number; type: 'slow'; ms: number }
  | { id: number; type: 'report' }
  | { id: number; type: 'close' };

/** A call as it crosses the IPC channel (bigints as strings). */
export type WireCall = Omit<FakeCall, 'start' | 'end'> & { start: string; end: string; cloud: 'daytona' | 'createos' };

const [seed, settling, transient] = process.argv.slice(2).map(Number) as [number, number, number];
const daytona = new DaytonaFake({
  apiKey: 'chaos-key',
  timings: { create: 30, start: 30, stop: 30, forceStop: 0, destroy: 20 },
  faults: { seed, settling, transient },
});
const createos = new CreateosFake({
  apiKey: 'chaos-key',
  timings: { create: 30, pause: 30, resume: 30, destroy: 20 },
  faults: { seed: seed + 1, settling, transient },
});
const wire = (cloud: WireCall['cloud']) => (c: FakeCall): WireCall => ({ ...c, start: String(c.start), end: String(c.end), cloud });

process.on('message', (req: CloudRequest) => {
  const answer = (body: unknown) => process.send!({ id: req.id, body });
  switch (req.type) {
    case 'control':
      if (req.cloud === 'createos') createos.control(req.id2, req.controls);
      else daytona.control(req.id2, req.controls);
      return answer(null);
    case 'slow':
      daytona.http.slowRepliesMs = createos.http.slowRepliesMs = req.ms;
      return answer(null);
    case 'report':
      return answer({ calls: [...daytona.calls.map(wire('daytona')), ...createos.calls.map(wire('createos'))], live: [...daytona.ids(), ...createos.live()] });
    case 'close':
      void Promise.all([daytona.close(), createos.close()]).then(() => {
        answer(null);
        process.disconnect();
      });
  }
});
const [daytonaUrl, createosUrl] = await Promise.all([daytona.listen(), createos.listen()]);
process.send!({ ready: { daytonaUrl, createosUrl } });
